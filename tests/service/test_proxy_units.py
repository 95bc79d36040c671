"""Pure pieces of the proxy node: request intake, header filters, output counting."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from coordinator.outliers import OutlierState, OutlierView
from coordinator.settings import Weights
from coordinator.snapshot import Snapshot
from proxy_node import usage
from proxy_node.app import render_metrics
from proxy_node.headers import copy_response_headers, request_headers
from proxy_node.intake import CompletionRequest, RequestRejectedError, parse_completion
from proxy_node.metrics import NodeMetrics
from proxy_node.usage import OutputCounter
from tests.library.test_strategies import row


def sse(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_parse_completion_sizes_and_stream_flag() -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 7, "stream": True}
    ).encode()
    assert parse_completion(body, None, 256) == CompletionRequest(10, 7, True, [])
    assert parse_completion(b'{"prompt": "abcd"}', "123", 99) == CompletionRequest(
        123, 99, False, []
    )
    assert parse_completion(b'{"prompt": "abcd", "stream": "yes"}', None, 5).stream is False
    # The hasher sees the decoded body; its hashes ride along.
    hashed = parse_completion(b'{"prompt": "abcd"}', None, 5, lambda b: [str(b["prompt"])])
    assert hashed.prefix_hashes == ["abcd"]


@pytest.mark.parametrize(
    ("raw", "header", "code"),
    [
        (b"{", None, "invalid_json"),
        (b"\xff\xfe", None, "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, None, "invalid_json"),
        (b'"text"', None, "invalid_body"),
        (b"{}", "ten", "invalid_header"),
        (b"{}", "99999999999", "invalid_header"),
    ],
    ids=["truncated", "not-utf8", "too-deep", "string", "header-not-int", "header-too-big"],
)
def test_parse_completion_rejects(raw: bytes, header: str | None, code: str) -> None:
    with pytest.raises(RequestRejectedError) as info:
        parse_completion(raw, header, 256)
    assert (info.value.status, info.value.code) == (400, code)


def test_output_counter_prefers_usage_then_counts_chunks() -> None:
    counter = OutputCounter(stream=True)
    for i in range(5):
        counter.feed(sse({"choices": [{"delta": {"content": f"t{i}"}}]}))
    # One event split across two network chunks still counts once.
    final = sse({"choices": [], "usage": {"completion_tokens": 42}})
    counter.feed(final[:20])
    counter.feed(final[20:] + b"data: [DONE]\n\n")
    assert counter.tokens() == 42
    plain = OutputCounter(stream=True)
    for i in range(3):
        plain.feed(sse({"choices": [{"delta": {"content": f"t{i}"}}]}))
    plain.feed(b"data: [DONE]\n\n")
    assert plain.tokens() == 3
    whole = OutputCounter(stream=False)
    doc = json.dumps({"choices": [], "usage": {"completion_tokens": 17}}).encode()
    whole.feed(doc[:10])
    whole.feed(doc[10:])
    assert whole.tokens() == 17
    broken = OutputCounter(stream=False)
    broken.feed(b"not json")
    assert broken.tokens() is None


@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_output_counter_reads_a_stream_the_same_however_the_network_splits_it(
    cuts: list[int],
) -> None:
    """Events and `[DONE]` split across chunks anywhere, even one byte at a time: the
    answer is whole, and its count is the same as in one piece."""
    events = [sse({"choices": [{"delta": {"content": f"t{i}"}}]}) for i in range(4)]
    body = b"".join(events) + b"data: [DONE]\n\n"
    at = sorted({min(c, len(body)) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *at], [*at, len(body)], strict=True)]
    counter = OutputCounter(stream=True)
    for piece in pieces:
        counter.feed(piece)
    assert counter.problem() is None
    assert counter.tokens() == 4
    assert (counter.events, counter.done_events) == (5, 1)


def test_a_stream_is_whole_only_when_its_last_event_is_done() -> None:
    said = sse({"choices": [{"delta": {"content": "data: [DONE]"}}]})
    cut = OutputCounter(stream=True)
    cut.feed(said)  # the model wrote the marker's text; the engine stopped after it
    assert cut.problem() == "truncated_stream"
    for last in (b"data: [DONE]\n\n", b"data:[DONE]\r\n\r\n", b"data: [DONE]"):
        whole = OutputCounter(stream=True)
        whole.feed(said + last)
        assert whole.problem() is None
    assert OutputCounter(stream=True).problem() == "empty_stream"


@pytest.mark.parametrize(
    ("last", "problem"),
    [
        (
            b'{"error": {"message": "CUDA error", "type": "InternalServerError", "code": 500}}',
            "error_event",
        ),
        (
            b'{"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}',
            "error_event",
        ),
        (b'{"choices": [], "usage": {"completion_tokens": 1}}', None),
        (b'{"choices": [{"delta": {"content": "an error"}}], "error": null}', None),
        (b'{"choices": [{"delta": {"content": "{\\"error\\": 1}"}}]}', None),
    ],
    ids=["error", "vllm-object-error", "usage", "null-error", "text-says-error"],
)
def test_an_error_event_before_done_is_a_failure(last: bytes, problem: str | None) -> None:
    """An engine that failed mid-generation answers 200, an error event and [DONE]
    (vLLM, SGLang): the client gets no completion, so the engine is at fault."""
    counter = OutputCounter(stream=True)
    counter.feed(sse({"choices": [{"delta": {"content": "t0"}}]}))
    counter.feed(b"data: " + last + b"\n\ndata: [DONE]\n\n")
    assert counter.problem() == problem


def test_output_counter_reads_a_stream_fed_byte_by_byte() -> None:
    body = sse({"choices": [{"delta": {"content": "x"}}]}) + b"data: [DONE]\n\n"
    counter = OutputCounter(stream=True)
    for i in range(len(body)):
        counter.feed(body[i : i + 1])
    assert (counter.problem(), counter.tokens()) == (None, 1)


def gzipped_pieces(body: bytes, size: int) -> list[bytes]:
    packed = gzip.compress(body)
    return [packed[i : i + size] for i in range(0, len(packed), size)]


@pytest.mark.parametrize("encoding", ["gzip", "GZIP", "x-gzip"])
def test_a_gzip_answer_is_judged_and_counted_decoded(encoding: str) -> None:
    doc = json.dumps({"choices": [], "usage": {"completion_tokens": 17}}).encode()
    whole = OutputCounter(stream=False, encoding=encoding)
    for piece in gzipped_pieces(doc, 7):
        whole.feed(piece)
    assert (whole.problem(), whole.tokens()) == (None, 17)
    events = b"".join(sse({"choices": [{"delta": {"content": f"t{i}"}}]}) for i in range(3))
    stream = OutputCounter(stream=True, encoding=encoding)
    for piece in gzipped_pieces(events + b"data: [DONE]\n\n", 5):
        stream.feed(piece)
    assert (stream.problem(), stream.tokens()) == (None, 3)
    cut = OutputCounter(stream=True, encoding=encoding)
    for piece in gzipped_pieces(events, 5):
        cut.feed(piece)
    assert cut.problem() == "truncated_stream"  # decoded, the stream still lacks [DONE]


def test_a_deflate_answer_is_judged_decoded() -> None:
    doc = json.dumps({"choices": [], "usage": {"completion_tokens": 5}}).encode()
    counter = OutputCounter(stream=False, encoding="deflate")
    counter.feed(zlib.compress(doc))
    assert (counter.problem(), counter.tokens()) == (None, 5)


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("br", b"\x1b\x00\xf8"),  # not read here: passed through
        ("gzip", b"not gzip at all"),  # the client will see it; not judged here
        ("deflate", zlib.compress(b"x")[2:]),  # raw deflate, which zlib headers reject
    ],
)
def test_an_answer_the_node_cannot_decode_is_not_judged(encoding: str, body: bytes) -> None:
    counter = OutputCounter(stream=True, encoding=encoding)
    counter.feed(body)
    assert (counter.problem(), counter.tokens()) == (None, None)


def test_a_compressed_answer_is_looked_into_only_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(usage, "DECODED_BYTES", 1000)
    counter = OutputCounter(stream=True, encoding="gzip")
    for piece in gzipped_pieces(b"data: x\n\n" * 100_000, 64):  # 900 KB in 2 KB
        counter.feed(piece)
        assert len(counter.tail) <= 1001
    assert (counter.overflow, counter.problem(), counter.tokens()) == (True, None, None)


def test_parse_completion_keeps_the_model_and_the_cap() -> None:
    """What the learned output length is looked up by, and bounded by."""
    parsed = parse_completion(b'{"model": "m", "prompt": "x", "max_tokens": 9}', None, 256)
    assert (parsed.model, parsed.output_cap, parsed.expected_output_tokens) == ("m", 9, 9)
    parsed = parse_completion(b'{"model": 5, "prompt": "x"}', None, 256)
    assert (parsed.model, parsed.output_cap, parsed.expected_output_tokens) == (None, None, 256)


def test_hop_by_hop_headers_are_filtered_both_ways() -> None:
    incoming = CIMultiDict(
        [
            ("Host", "node:8001"),
            ("Connection", "keep-alive, X-Secret-Hop"),
            ("X-Secret-Hop", "1"),
            ("Authorization", "Bearer engine-key"),
            ("Content-Length", "10"),
            ("X-Request-Id", "spoofed"),
            ("Accept", "text/event-stream"),
        ]
    )
    out = request_headers(incoming, "rid-1")
    assert dict(out) == {
        "Authorization": "Bearer engine-key",
        "Accept": "text/event-stream",
        "X-Request-Id": "rid-1",
    }
    response = web.StreamResponse()
    upstream = CIMultiDict(
        [
            ("Content-Type", "text/event-stream"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "5"),
            ("X-Instance-Id", "forged"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
        ]
    )
    copy_response_headers(upstream, response)
    assert list(response.headers.items()) == [
        ("Content-Type", "text/event-stream"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]


def test_prediction_error_is_relative_to_the_observed_ttft() -> None:
    metrics = NodeMetrics("n", "p", "test")
    metrics.observe_prediction_error("e0", predicted_ms=150.0, observed_ms=100.0)  # 0.5
    metrics.observe_prediction_error("e0", predicted_ms=90.0, observed_ms=100.0)  # 0.1
    metrics.observe_prediction_error("e0", predicted_ms=10.0, observed_ms=0.0)  # none
    sample = metrics.registry.get_sample_value
    name = "proxy_ttft_prediction_relative_error"
    assert sample(f"{name}_count", {"instance": "e0"}) == 2
    assert sample(f"{name}_sum", {"instance": "e0"}) == pytest.approx(0.6)
    assert sample(f"{name}_bucket", {"instance": "e0", "le": "0.1"}) == 1
    assert sample(f"{name}_bucket", {"instance": "e0", "le": "0.3"}) == 1
    assert sample(f"{name}_bucket", {"instance": "e0", "le": "0.5"}) == 2


@pytest.mark.parametrize(
    ("states", "scored"),
    [
        ({}, {"e0", "e1", "e2"}),
        # Ejected and cordoned instances are out of selection: no score.
        ({"e0": OutlierState("e0", ejected_until_ms=2000), "e1": OutlierState("e1", cordon="")},
         {"e2"}),
        # Every alive one ejected or cordoned: selection takes the ejected (an ejected
        # instance beats none), never the cordoned, and so does the score.
        ({"e0": OutlierState("e0", ejected_until_ms=2000), "e1": OutlierState("e1", cordon=""),
          "e2": OutlierState("e2", ejected_until_ms=2000)},
         {"e0", "e2"}),
    ],
)  # fmt: skip
def test_metrics_score_the_instances_selection_would_take(
    states: dict[str, OutlierState], scored: set[str]
) -> None:
    snap = Snapshot(1000, 1, [row("e0"), row("e1"), row("e2")])
    metrics = NodeMetrics("n", "p", "test")
    render_metrics(metrics, snap, OutlierView(1000, states), Weights())
    sample = metrics.registry.get_sample_value
    shown = {
        iid
        for iid in ("e0", "e1", "e2")
        if sample("proxy_instance_least_load_score", {"pool": "p", "instance": iid}) is not None
    }
    assert shown == scored
