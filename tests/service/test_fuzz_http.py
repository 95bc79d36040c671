"""Hypothesis fuzz of both planes of a running node: bad input gets a JSON 4xx, never a 5xx.

Every example is sent over loopback to a real node (aiohttp AppRunner) on the real
test Redis, and each test computes the exact answer it expects from the input alone
(JSON parsing, the documented field rules), so the fuzz checks more than "not 500":

- service plane, one fake engine registered: an unusable body or header gets 400 (or
  413 above the body limit) with a JSON error and never reaches the engine; a usable
  one, however odd its fields and headers, is a valid request and gets the engine's
  200.
- control plane, with a token: a write without the exact token gets 401; a malformed
  body 400; an invalid spec or hint 422; an unknown instance 404; a valid spec 201.

Two answers are outside "4xx with a JSON error", by design:
- with no alive instance, a valid request gets 503 `no_instance` (DESIGN.md §5), a
  JSON error too: `test_valid_requests_without_an_instance_get_503_no_instance`;
- what the HTTP parser refuses before any handler runs (a header over the limits,
  control bytes in a header, a body failing its Content-Encoding inside the first
  packet) gets aiohttp's plain-text 400: tests/service/test_security.py covers the limits,
  `test_a_body_that_fails_its_content_encoding_is_400` the encodings.

After each fuzz no reservation is left and the spec hash holds only the instances
the test registered itself.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from yarl import URL

from coordinator import InstanceSpec
from coordinator.coordinator import MAX_TOKENS
from coordinator.errors import InvalidArgumentError
from coordinator.keys import ID_RE
from coordinator.models import HINT_NAMES
from coordinator.settings import STRATEGIES
from tests.fake_engine import FakeEngine, Harness, NodeServer, settled
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

TOKEN = "fuzz-token"
MAX_BODY = 16 * 1024  # the service plane's body limit in these tests
CONTROL_MAX_BODY = 1024**2  # aiohttp's default client_max_size (the control app keeps it)
KEEPER = "keeper"  # the one instance the control-plane fuzz registers itself
SERVED = "e0"  # the instance the node under fuzz serves (never to be unregistered)
MAX_SLOTS_LUA = 1_000_000  # register.lua's bound on max_slots
EPOCH_LUA = 10**15  # _lib.lua int_arg's default bound
HINT_LUA = 1e12  # heartbeat.lua's bound on a hint value
RESERVATIONS_LIMIT = 100_000  # control.MAX_RESERVATIONS_LIMIT


def fuzz_settings(examples: int) -> Any:
    """Hypothesis settings shared by every fuzz (one node per test, no deadline)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# ---------------------------------------------------------------------- strategies

# Printable text (no control characters: the HTTP parser refuses them in headers).
printable = st.characters(blacklist_categories=("Cc", "Cs"))
header_text = st.text(printable, max_size=40)
past_float = st.integers(min_value=2 * 10**308, max_value=10**400)  # float(n) overflows
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | past_float
    | st.floats()  # NaN and infinities too: Python's json accepts them
    | st.text(max_size=20)
    | st.just("\ud800")  # a lone surrogate, sent as a \u escape
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
# Long strings whose JSON form is up to 2 x MAX_BODY bytes, whatever the escaping.
huge_strings = st.builds(
    lambda c, n: c * (n // len(json.dumps(c))),
    st.sampled_from(["x", "é", "😀", '"', "\n", "\u0000", "\ud800"]) | st.characters(),
    st.integers(0, 2 * MAX_BODY),
)
anything = json_values | huge_strings

COMPLETION_FIELDS = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "stop",
)
odd_messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "name"]), anything, max_size=3) | anything,
    max_size=4,
)
completion_objects = st.builds(
    lambda known, extra: {**extra, **known},
    st.fixed_dictionaries(
        {},
        optional={
            name: odd_messages if name == "messages" else anything for name in COMPLETION_FIELDS
        },
    ),
    st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)


def json_bytes(doc: Any, ascii_only: bool) -> bytes:
    """Encode a document as JSON text (NaN/Infinity literals included, as Python does)."""
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


not_objects = json_values.filter(lambda v: not isinstance(v, dict)).map(
    lambda v: json_bytes(v, True)
)
invalid_utf8 = st.builds(
    lambda head, bad: b'{"prompt": "' + head.encode() + bad + b'"}',
    st.text(max_size=10),
    st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]),
)
truncated = st.builds(
    lambda doc, cut: json_bytes(doc, True)[: max(0, len(json_bytes(doc, True)) - cut)],
    st.dictionaries(st.text(max_size=5), json_values, min_size=1, max_size=3),
    st.integers(1, 5),
)
bad_bodies = not_objects | invalid_utf8 | truncated | st.binary(max_size=64)


def parse(raw: bytes) -> tuple[bool, Any]:
    """(parsed, document) by Python's own JSON rules (the proxy uses the same)."""
    try:
        return True, json.loads(raw)
    except (ValueError, RecursionError):
        return False, None


def prompt_header_ok(value: str) -> bool:
    """Whether the node accepts this X-Prompt-Tokens value (HTTP strips outer SP/HTAB)."""
    try:
        n = int(value.strip(" \t"))
    except ValueError:
        return False
    return 0 <= n <= MAX_TOKENS


prompt_tokens_values = (
    st.integers(0, MAX_TOKENS).map(str)
    | st.integers().map(str)
    | header_text
    | st.sampled_from(["", "-1", "1e3", "0x10", "NaN", " 7 ", "1_000", "٣", "9" * 5000])
)
request_ids = (
    st.from_regex(ID_RE, fullmatch=True)
    | header_text
    | st.integers(129, 4000).map(lambda n: "r" * n)  # long, but under the header limit
)
authorizations = header_text | st.sampled_from(
    ["", "Bearer", "Bearer ", "bearer " + TOKEN, "Basic Zm9vOmJhcg==", "Bearer " + TOKEN + "x"]
)
content_types = header_text | st.sampled_from(
    [
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=zz",
        "application/json; charset=latin-1",
        "*/*",
    ]
)
extra_headers = st.dictionaries(
    st.sampled_from(["Accept", "Accept-Encoding", "X-Forwarded-For", "User-Agent", "X-Junk"]),
    header_text,
    max_size=3,
)


@st.composite
def odd_headers(draw: st.DrawFn) -> dict[str, str]:
    """Headers a client may send; X-Prompt-Tokens is added by the caller."""
    headers = draw(extra_headers)
    for name, values in (
        ("Content-Type", content_types),
        ("X-Request-Id", request_ids),
        ("Authorization", authorizations),
    ):
        if draw(st.booleans()):
            headers[name] = draw(values)
    return headers


@dataclass
class Case:
    """One request and the exact answer it must get."""

    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200
    codes: frozenset[str] = frozenset()  # acceptable error codes (for an error status)


@st.composite
def service_cases(draw: st.DrawFn) -> Case:
    """A completion request, usable or not, with its exact expected answer."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    headers = draw(odd_headers())
    if draw(st.booleans()):
        headers["X-Prompt-Tokens"] = draw(prompt_tokens_values)
    if draw(st.integers(0, 2)) == 0:
        body = draw(bad_bodies)
    else:
        body = json_bytes(draw(completion_objects), draw(st.booleans()))
    decoded_size = len(body)
    encoding = draw(st.sampled_from([None, None, "identity", "x-unknown", "gzip"]))
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    if encoding == "gzip":
        body = gzip.compress(body)
    ok, doc = parse(gzip.decompress(body) if encoding == "gzip" else body)
    if decoded_size > MAX_BODY:
        return Case("POST", path, body, headers, 413, frozenset({"body_too_large"}))
    if not ok:
        return Case("POST", path, body, headers, 400, frozenset({"invalid_json"}))
    if not isinstance(doc, dict):
        return Case("POST", path, body, headers, 400, frozenset({"invalid_body"}))
    prompt = headers.get("X-Prompt-Tokens")
    if prompt is not None and not prompt_header_ok(prompt):
        return Case("POST", path, body, headers, 400, frozenset({"invalid_header"}))
    if not output_caps_ok(doc):
        return Case("POST", path, body, headers, 400, frozenset({"invalid_max_tokens"}))
    return Case("POST", path, body, headers, 200)


def output_caps_ok(doc: dict[str, Any]) -> bool:
    """The output caps the node reads: absent, null, or an integer in 1..10,000,000."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**7:
            return False
    return True


# ---------------------------------------------------------------------- helpers


@dataclass
class Answer:
    """What came back."""

    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]


async def send(http: aiohttp.ClientSession, base: str, case: Case) -> Answer:
    """Send one case; the path is already percent-encoded."""
    url = URL(base + case.path, encoded=True)
    async with http.request(
        case.method,
        url,
        data=case.body if case.body else None,
        headers=case.headers,
        skip_auto_headers=("Content-Type",),
    ) as resp:
        return Answer(resp.status, resp.content_type, await resp.read(), dict(resp.headers))


def assert_fuzzed(answer: Answer, case: Case) -> None:
    """assert_answer, and count the expected answer in hypothesis' statistics."""
    event(f"status {case.status} {'/'.join(sorted(case.codes))}")
    assert_answer(answer, case)


def assert_answer(answer: Answer, case: Case) -> None:
    """The status is the expected one; an error carries a well-formed JSON error body."""
    detail = f"{case.method} {case.path[:80]} {case.headers!r:.300} {case.body[:120]!r}"
    assert answer.status == case.status, (answer.status, answer.body[:300], detail)
    assert answer.status < 500, detail
    if answer.status < 400:
        return
    assert answer.content_type == "application/json", (answer.content_type, detail)
    doc = json.loads(answer.body)
    error = doc["error"]
    assert isinstance(error["message"], str) and error["message"], doc
    assert isinstance(error["type"], str) and error["type"], doc
    if case.codes:
        assert error["code"] in case.codes, (doc, detail)


async def spec_ids(node: NodeServer) -> set[str]:
    """Instance ids in the pool's spec hash."""
    return set(await node.coordinator.redis.hkeys(node.coordinator.keys.column("spec")))


async def assert_nothing_left(node: NodeServer, registered: set[str]) -> None:
    """No reservation, every counter 0, and only the test's own instances registered."""
    await wait_for(lambda: settled(node.coordinator), what="no reservation left")
    assert await node.coordinator.redis.hlen(node.coordinator.keys.column("reservations")) == 0
    assert await spec_ids(node) == registered


@dataclass
class Served:
    """A node with one fake engine registered as `e0`; `registered` is what may stay."""

    harness: Harness
    node: NodeServer
    engine: FakeEngine
    registered: set[str]


@pytest.fixture
async def served(harness: Harness) -> AsyncIterator[Served]:
    """The node under fuzz; after all examples, nothing may be left behind in Redis."""
    engine = await harness.engine(chunks=2)
    # No heartbeats here: a long TTL keeps e0 alive for the whole fuzz.
    coordinator = await harness.coordinator(instance_ttl_ms=3_600_000)
    node = await harness.node(coordinator, token=TOKEN, max_body_bytes=MAX_BODY)
    await node.coordinator.register_instance(InstanceSpec(id=SERVED, url=engine.url))
    served = Served(harness, node, engine, {SERVED})
    yield served
    await assert_nothing_left(node, served.registered)


@pytest.fixture
async def controlled(served: Served) -> Served:
    """The same node with a second instance, the one heartbeats may reach."""
    await served.node.coordinator.register_instance(InstanceSpec(id=KEEPER, url="http://h:1"))
    served.registered.add(KEEPER)
    return served


# ---------------------------------------------------------------------- service plane


async def _none_left(node: NodeServer) -> bool:
    """Whether the node's pool holds no reservation right now."""
    return int(await node.coordinator.redis.hlen(node.coordinator.keys.column("reservations"))) == 0


@fuzz_settings(150)
@given(case=service_cases())
async def test_service_plane_fuzz(served: Served, case: Case) -> None:
    before = served.engine.requests
    answer = await send(served.harness.http, served.node.url, case)
    assert_fuzzed(answer, case)
    if case.status == 200:
        assert served.engine.requests == before + 1
        assert answer.headers["X-Instance-Id"] == "e0"
    else:
        assert served.engine.requests == before, "a refused request reached the engine"
    # The node releases right after the last byte went out: wait, with a deadline.
    await wait_for(
        lambda: _none_left(served.node), timeout_s=5, what="the reservation to be released"
    )


@pytest.fixture
async def bare_node(harness: Harness) -> AsyncIterator[NodeServer]:
    """A node whose pool has no instance at all."""
    node = await harness.node()
    yield node
    await assert_nothing_left(node, set())


@fuzz_settings(40)
@given(body=completion_objects, headers=odd_headers())
async def test_valid_requests_without_an_instance_get_503_no_instance(
    harness: Harness, bare_node: NodeServer, body: dict[str, Any], headers: dict[str, str]
) -> None:
    # The one designed 5xx for client input: DESIGN.md §5 answers "no alive instance"
    # with 503 no_instance, a JSON error like every other.
    headers.pop("X-Prompt-Tokens", None)
    raw = json_bytes(body, True)
    if len(raw) > bare_node.config.max_body_bytes:
        status, code = 413, "body_too_large"
    elif not output_caps_ok(body):
        status, code = 400, "invalid_max_tokens"
    else:
        status, code = 503, "no_instance"
    case = Case("POST", "/v1/chat/completions", raw, headers, status, frozenset({code}))
    answer = await send(harness.http, bare_node.url, case)
    assert answer.status == status, answer.body[:300]
    assert answer.content_type == "application/json"
    assert json.loads(answer.body)["error"]["code"] == code


unknown_paths = st.lists(
    st.text(max_size=12).filter(lambda p: p not in (".", "..")), min_size=1, max_size=4
).map(lambda parts: "/zz-fuzz/" + "/".join(quote(p, safe="") for p in parts))


@fuzz_settings(60)
@given(
    plane=st.sampled_from(["service", "control"]),
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]),
    path=unknown_paths,
    body=st.binary(max_size=32),
)
async def test_unknown_routes_are_json_404(
    served: Served, plane: str, method: str, path: str, body: bytes
) -> None:
    base = served.node.url if plane == "service" else served.node.control_url
    case = Case(method, path, body, {"Authorization": f"Bearer {TOKEN}"}, 404)
    assert_fuzzed(await send(served.harness.http, base, case), case)


@pytest.mark.parametrize(
    ("plane", "method", "path"),
    [
        ("service", "GET", "/v1/chat/completions"),
        ("service", "DELETE", "/v1/completions"),
        ("service", "POST", "/v1/models"),
        ("service", "PUT", "/healthz"),
        ("control", "PUT", "/v1/instances"),
        ("control", "GET", "/v1/instances/e0/heartbeat"),
        ("control", "POST", "/debug/reservations"),
        ("control", "PATCH", "/metrics"),
    ],
)
async def test_wrong_methods_are_json_405(
    served: Served, plane: str, method: str, path: str
) -> None:
    base = served.node.url if plane == "service" else served.node.control_url
    case = Case(method, path, b"{}", {"Authorization": f"Bearer {TOKEN}"}, 405)
    answer = await send(served.harness.http, base, case)
    assert_answer(answer, case)
    assert answer.headers.get("Allow")


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
@pytest.mark.parametrize("framing", ["one-packet", "chunked"])
async def test_a_body_that_fails_its_content_encoding_is_400(
    served: Served, encoding: str, framing: str
) -> None:
    """Never a 500: JSON when the handler meets the error, aiohttp's text when its parser does."""
    junk = b"\x00not-compressed" * 64

    async def chunks() -> AsyncIterator[bytes]:
        yield junk[:1]  # the handler may start on this before the rest arrives
        yield junk[1:]

    for base, path in (
        (served.node.url, "/v1/chat/completions"),
        (served.node.control_url, "/v1/instances"),
    ):
        data: Any = junk if framing == "one-packet" else chunks()
        headers = {"Content-Encoding": encoding, "Authorization": f"Bearer {TOKEN}"}
        async with served.harness.http.post(base + path, data=data, headers=headers) as resp:
            body = await resp.read()
            assert resp.status == 400, (base, body)
            if resp.content_type == "application/json":
                assert json.loads(body)["error"]["code"] == "invalid_body"
            else:
                assert resp.content_type == "text/plain", resp.content_type
    assert served.engine.requests == 0


async def test_a_gzip_request_reaches_the_engine_decoded(served: Served) -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "zipped"}]}).encode()
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    url = served.node.url + "/v1/chat/completions"
    async with served.harness.http.post(url, data=gzip.compress(raw), headers=headers) as resp:
        assert resp.status == 200, await resp.read()
    assert served.engine.bodies == [raw]


# ---------------------------------------------------------------------- control plane


def authorized(headers: dict[str, str]) -> bool:
    """Whether the node accepts the Authorization header (HTTP strips outer SP/HTAB)."""
    return headers.get("Authorization", "").strip(" \t") == f"Bearer {TOKEN}"


@st.composite
def auth_headers(draw: st.DrawFn) -> dict[str, str]:
    """Mostly the right token; sometimes junk or none; plus odd headers."""
    headers = draw(odd_headers())
    if draw(st.sampled_from(["right", "right", "right", "as drawn"])) == "right":
        headers["Authorization"] = f"Bearer {TOKEN}"
    return headers


fresh_ids = st.from_regex(ID_RE, fullmatch=True).filter(lambda s: s not in (KEEPER, SERVED))
spec_fields = {
    "id": json_values | fresh_ids,
    "url": json_values | st.sampled_from(["http://127.0.0.1:9", "https://x", "ftp://x", ""]),
    "role": json_values | st.sampled_from(["mixed", "prefill", "decode", "boss"]),
    "max_slots": json_values | past_float | st.integers(-2, 2 * MAX_SLOTS_LUA),
    "weight": json_values | past_float | st.floats(-1, 10),
    "prefill_ms_per_token": json_values | past_float | st.floats(),
    "prefill_overhead_ms": json_values | past_float | st.floats(),
    "decode_ms_per_token": json_values | past_float | st.floats(),
    "epoch": json_values | past_float | st.integers(-1, 2 * EPOCH_LUA),
    "model": json_values | huge_strings,
    "tags": json_values | st.lists(st.text(max_size=5), max_size=3),
    "bogus": json_values,
}


@st.composite
def spec_bodies(draw: st.DrawFn) -> bytes:
    """A registration body: a valid spec with some fields replaced, dropped or added."""
    # The control plane's body limit is tested in tests/service/test_security.py.
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(bad_bodies)
    if kind == 1:
        return json_bytes(draw(json_values), True)
    doc: dict[str, Any] = {"id": draw(fresh_ids), "url": "http://127.0.0.1:9"}
    for name in draw(st.lists(st.sampled_from(sorted(spec_fields)), max_size=3, unique=True)):
        if draw(st.integers(0, 3)) == 0:
            doc.pop(name, None)
        else:
            doc[name] = draw(spec_fields[name])
    return json_bytes(doc, draw(st.booleans()))


def expect_register(raw: bytes) -> tuple[int, frozenset[str]]:
    """The exact answer to a registration body (a fresh id: never 409)."""
    if len(raw) > CONTROL_MAX_BODY:
        return 413, frozenset()
    ok, doc = parse(raw)
    if not ok:
        return 400, frozenset({"invalid_json"})
    try:
        spec = InstanceSpec.from_dict(doc)
    except (InvalidArgumentError, OverflowError):
        return 422, frozenset({"invalid_instance"})
    if spec.max_slots > MAX_SLOTS_LUA or spec.epoch > EPOCH_LUA:
        return 422, frozenset({"invalid_instance"})
    return 201, frozenset()


@fuzz_settings(150)
@given(raw=spec_bodies(), headers=auth_headers())
async def test_register_fuzz(served: Served, raw: bytes, headers: dict[str, str]) -> None:
    status, codes = expect_register(raw)
    if not authorized(headers):
        status, codes = 401, frozenset({"unauthorized"})
    case = Case("POST", "/v1/instances", raw, headers, status, codes)
    answer = await send(served.harness.http, served.node.control_url, case)
    assert_fuzzed(answer, case)
    if status == 201:
        instance_id = json.loads(raw)["id"]
        assert json.loads(answer.body)["instance_id"] == instance_id
        delete = Case("DELETE", f"/v1/instances/{instance_id}", headers={**headers}, status=200)
        assert_answer(await send(served.harness.http, served.node.control_url, delete), delete)
    assert await spec_ids(served.node) == served.registered


def hint_ok(value: Any) -> bool:
    """Whether one hint value passes the node and heartbeat.lua."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return not math.isnan(number) and 0 <= number <= HINT_LUA


def expect_heartbeat(instance_id: str, raw: bytes) -> tuple[int, frozenset[str]]:
    """The exact answer: route, body (400, 422), id syntax (404), values (422), existence."""
    if any(c in instance_id for c in "{}"):  # aiohttp's {name} segments exclude braces
        return 404, frozenset({"not_found"})
    if raw.strip():
        ok, body = parse(raw)
        if not ok:
            return 400, frozenset({"invalid_json"})
    else:
        body = None
    bad = 422, frozenset({"invalid_hints"})
    if body is not None:
        if not isinstance(body, dict):
            return bad
        if "hints" in body:
            if set(body) != {"hints"}:
                return bad
            body = body["hints"] if body["hints"] is not None else {}
            if not isinstance(body, dict):
                return bad
        if set(body) - set(HINT_NAMES):
            return bad
    if not ID_RE.match(instance_id):
        return 404, frozenset({"unknown_instance"})
    if body is not None and not all(hint_ok(v) for v in body.values()):
        return bad  # checked before the instance's existence, by the node and the script
    if instance_id != KEEPER:
        return 404, frozenset({"unknown_instance"})
    return 200, frozenset()


hint_values = json_values | st.integers(-5, 10**13) | st.floats(-1, 2e12) | past_float
hint_dicts = st.dictionaries(st.sampled_from([*HINT_NAMES, "bogus"]), hint_values, max_size=3)
nested_hints = st.builds(
    lambda hints, extra: json_bytes({"hints": hints, **extra}, True),
    hint_dicts | json_values,
    st.dictionaries(st.sampled_from(["x", *HINT_NAMES]), json_values, max_size=1),
)
heartbeat_bodies = st.one_of(
    st.sampled_from([b"", b"  \n", b"null", b"{}"]),
    bad_bodies,
    hint_dicts.map(lambda d: json_bytes(d, True)),
    hint_dicts.map(lambda d: json_bytes(d, True)),
    nested_hints,
)
# Ids as path segments: no '/' and not all dots (those change the route, not the id).
path_ids = (
    st.just(KEEPER)
    | fresh_ids
    | st.text(printable, min_size=1, max_size=20).filter(
        lambda s: "/" not in s and s.strip(".") != ""
    )
)


@fuzz_settings(150)
@given(
    instance_id=st.one_of(st.just(KEEPER), path_ids), raw=heartbeat_bodies, headers=auth_headers()
)
async def test_heartbeat_fuzz(
    controlled: Served, instance_id: str, raw: bytes, headers: dict[str, str]
) -> None:
    # Any registered id (the keeper, or the served engine `e0`) answers like the keeper.
    known = instance_id in controlled.registered
    status, codes = expect_heartbeat(KEEPER if known else instance_id, raw)
    if not authorized(headers):
        status, codes = 401, frozenset({"unauthorized"})
    path = f"/v1/instances/{quote(instance_id, safe='')}/heartbeat"
    case = Case("POST", path, raw, headers, status, codes)
    assert_fuzzed(await send(controlled.harness.http, controlled.node.control_url, case), case)
    assert await spec_ids(controlled.node) == controlled.registered


@fuzz_settings(60)
# Any id but the two this fuzz keeps registered: unregistering one of those succeeds.
@given(instance_id=path_ids.filter(lambda s: s not in (KEEPER, SERVED)), headers=auth_headers())
async def test_unregister_fuzz(
    controlled: Served, instance_id: str, headers: dict[str, str]
) -> None:
    unroutable = any(c in instance_id for c in "{}")
    status, codes = 404, frozenset({"not_found" if unroutable else "unknown_instance"})
    if not authorized(headers):
        status, codes = 401, frozenset({"unauthorized"})
    path = f"/v1/instances/{quote(instance_id, safe='')}"
    case = Case("DELETE", path, b"", headers, status, codes)
    assert_fuzzed(await send(controlled.harness.http, controlled.node.control_url, case), case)
    assert await spec_ids(controlled.node) == controlled.registered


def expect_query(path: str, value: str) -> int:
    """200 or 400 for one query parameter of a read endpoint."""
    if path == "/debug/instance_loads":
        return 200 if value in STRATEGIES else 400
    if path == "/debug/reservations":
        try:
            limit = int(value)
        except ValueError:
            return 400
        return 200 if 1 <= limit <= RESERVATIONS_LIMIT else 400
    return 200


@fuzz_settings(100)
@given(
    target=st.sampled_from(
        [
            ("/v1/instances", "include_dead"),
            ("/debug/instance_loads", "strategy"),
            ("/debug/reservations", "limit"),
            ("/healthz", "x"),
            ("/metrics", "x"),
        ]
    ),
    value=st.text(printable, max_size=30)
    | st.sampled_from([*STRATEGIES, "0", "1", "100000", "100001", " 5", "-1", "1e3", "٣"]),
    headers=odd_headers(),
)
async def test_read_endpoints_fuzz(
    served: Served, target: tuple[str, str], value: str, headers: dict[str, str]
) -> None:
    path, name = target
    status = expect_query(path, value)
    case = Case("GET", f"{path}?{name}={quote(value, safe='')}", b"", headers, status)
    answer = await send(served.harness.http, served.node.control_url, case)
    assert_fuzzed(answer, case)
    if path != "/metrics":
        assert isinstance(json.loads(answer.body), dict)
