"""The control plane, the debug views, hint scraping, configuration and `coordinator serve`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from coordinator import InstanceSpec
from coordinator.errors import InvalidArgumentError
from coordinator.outliers import OutlierPolicy
from coordinator_cli.main import build_parser
from local_fleet.embedded import free_port
from proxy_node import hints
from proxy_node.config import NodeConfig, instance_id_for
from proxy_node.hints import live_node_ids, parse_engine_metrics, rendezvous_owner
from proxy_node.views import instance_loads_view
from tests.fake_engine import Harness, NodeServer, settled
from tests.helpers import counters, private_server, served, wait_for

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def call(
    harness: Harness, method: str, url: str, body: Any = None, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with harness.http.request(method, url, data=data, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_instance_lifecycle_through_the_control_plane(harness: Harness) -> None:
    node = await harness.node()
    base = node.control_url + "/v1/instances"
    status, doc = await call(harness, "POST", base, {"id": "e1", "url": "http://127.0.0.1:9"})
    assert status == 201
    assert doc == {
        "instance_id": "e1",
        "epoch": 1,
        "status": "new",
        "voided_reservations": 0,
        "heartbeat_interval_s": 3.0,
        "ttl_s": 10.0,
    }
    assert await call(harness, "POST", base + "/e1/heartbeat") == (200, {"epoch": 1})
    flat = {"engine_running": 2, "engine_waiting": 1, "queue_depth": 0}
    assert await call(harness, "POST", base + "/e1/heartbeat", flat) == (200, {"epoch": 1})
    nested = {"hints": {"engine_running": 3}}  # what proxy_node.engine_registration sends
    assert await call(harness, "POST", base + "/e1/heartbeat", nested) == (200, {"epoch": 1})
    row = (await node.coordinator.snapshot()).by_id()["e1"]
    assert (row.engine_running, row.engine_waiting) == (3.0, 1.0)
    for bad in ({"engine_running": -1}, {"engine_running": "x"}, {"bogus": 1}, [1]):
        status, doc = await call(harness, "POST", base + "/e1/heartbeat", bad)
        assert status == 422 and doc["error"]["code"] == "invalid_hints", bad
    status, doc = await call(harness, "POST", base + "/e1/heartbeat", b"{nope")
    assert status == 400 and doc["error"]["code"] == "invalid_json"
    status, doc = await call(harness, "POST", base + "/nobody/heartbeat")
    assert status == 404 and doc["error"]["code"] == "unknown_instance"
    status, doc = await call(harness, "GET", base)
    assert [i["id"] for i in doc["instances"]] == ["e1"]
    status, doc = await call(
        harness, "POST", base, {"id": "e1", "url": "http://127.0.0.1:9", "epoch": 5}
    )
    assert (status, doc["epoch"], doc["status"]) == (201, 5, "restarted")
    status, doc = await call(
        harness, "POST", base, {"id": "e1", "url": "http://127.0.0.1:9", "epoch": 4}
    )
    assert status == 409 and doc["error"]["code"] == "epoch_fenced"
    assert (await call(harness, "DELETE", base + "/e1"))[0] == 200
    status, doc = await call(harness, "DELETE", base + "/e1")
    assert status == 404 and doc["error"]["code"] == "unknown_instance"
    assert (await call(harness, "GET", base + "?include_dead=true"))[1]["instances"] == []
    assert (await call(harness, "GET", node.control_url + "/nowhere"))[0] == 404


@pytest.mark.parametrize(
    "body",
    [
        {"url": "http://127.0.0.1:9"},
        {"id": "bad id", "url": "http://127.0.0.1:9"},
        {"id": "e1", "url": "ftp://x"},
        {"id": "e1", "url": "http://127.0.0.1:9", "role": "boss"},
        {"id": "e1", "url": "http://127.0.0.1:9", "max_slots": -1},
        {"id": "e1", "url": "http://127.0.0.1:9", "surprise": 1},
        ["e1"],
        {"id": "e1\n", "url": "http://127.0.0.1:9"},
        {"id": "e1", "url": "http://127.0.0.1:9", "prefill_ms_per_token": 1e300},
        {"id": "e1", "url": "http://127.0.0.1:9", "decode_ms_per_token": 1.7e308},
        {"id": "e1", "url": "http://127.0.0.1:9", "prefill_overhead_ms": 1e12},
        {"id": "e1", "url": "http://127.0.0.1:9", "max_slots": 10**7},
    ],
    ids=[
        "no-id",
        "bad-id",
        "bad-url",
        "bad-role",
        "bad-slots",
        "unknown-field",
        "not-object",
        "id-newline",
        "huge-prefill",
        "huge-decode",
        "huge-overhead",
        "huge-slots",
    ],
)
async def test_invalid_registration_is_422(harness: Harness, body: Any) -> None:
    node = await harness.node()
    status, doc = await call(harness, "POST", node.control_url + "/v1/instances", body)
    assert status == 422
    assert doc["error"]["code"] == "invalid_instance" and doc["error"]["message"]
    assert await node.coordinator.list_instances(include_dead=True) == []


@pytest.mark.parametrize("method", ["DELETE", "POST"])
async def test_an_id_with_a_trailing_newline_is_a_4xx(harness: Harness, method: str) -> None:
    """`abc%0A` once passed the `$`-anchored id check and became a 500 in the script."""
    node = await harness.node()
    base = node.control_url + "/v1/instances"
    assert (await call(harness, "POST", base, {"id": "abc", "url": "http://127.0.0.1:9"}))[0] == 201
    path = base + "/abc%0A" + ("/heartbeat" if method == "POST" else "")
    status, doc = await call(harness, method, path)
    assert status == 404, doc
    assert doc["error"]["code"] == "unknown_instance"
    assert [r.id for r in await node.coordinator.list_instances()] == ["abc"]


async def test_token_guards_writes_and_leaves_reads_open(harness: Harness) -> None:
    node = await harness.node(token="s3cret")
    base = node.control_url + "/v1/instances"
    spec = {"id": "e1", "url": "http://127.0.0.1:9"}
    for token in (None, "wrong", "s3cret-and-more"):
        status, doc = await call(harness, "POST", base, spec, token)
        assert status == 401 and doc["error"]["code"] == "unauthorized"
    assert await node.coordinator.list_instances(include_dead=True) == []
    assert (await call(harness, "POST", base, spec, "s3cret"))[0] == 201
    assert (await call(harness, "POST", base + "/e1/heartbeat"))[0] == 401
    assert (await call(harness, "DELETE", base + "/e1"))[0] == 401
    for path in ("/v1/instances", "/debug/instance_loads", "/debug/reservations", "/healthz"):
        assert (await call(harness, "GET", node.control_url + path))[0] == 200, path
    assert (await call(harness, "DELETE", base + "/e1", token="s3cret"))[0] == 200


async def decoding(node: NodeServer, n: int) -> bool:
    """n first tokens marked, in Redis and in the node's own view (the mark rides on a
    later call, carry_ms, and its reply brings the view the changed record)."""
    c = node.coordinator
    in_view = sum(row.active_decode for row in c._cache.rows.values())
    return in_view == n and sum((await counters(c))["active_decode"].values()) == n


def _absolute(view: dict[str, Any]) -> dict[str, Any]:
    """The view with every age turned into the absolute Redis time it measures from."""
    out: dict[str, Any] = json.loads(json.dumps(view))
    now = out.pop("generated_at")
    for row in out["instances"]:
        row["last_seen_at_ms"] = now - row.pop("last_seen_age_ms")
        row["hint_at_ms"] = {k: now - v for k, v in row.pop("hint_ages_ms").items()}
        for hint in row["hints"].values():
            hint["at_ms"] = now - hint.pop("age_ms")
    return out


async def test_debug_instance_loads_is_the_snapshot_selection_uses(harness: Harness) -> None:
    engines = [await harness.engine(gate_after=1) for _ in range(3)]
    node = await harness.node()
    base = node.control_url + "/v1/instances"
    # Far apart: the default weights also count each request's predicted TTFT, and e0's
    # first request teaches the node e0's prefill speed (a `scaled` estimate from one
    # sample, through the proxy: slower than the default the others keep).
    for i, (engine, running) in enumerate(zip(engines, (0, 20, 40), strict=True)):
        assert (await call(harness, "POST", base, {"id": f"e{i}", "url": engine.url}))[0] == 201
        hints = {"engine_running": running, "engine_waiting": 1}
        assert (await call(harness, "POST", f"{base}/e{i}/heartbeat", hints))[0] == 200
    held = []
    for marked in (1, 2):
        resp = await harness.http.post(node.url + "/v1/chat/completions", json=CHAT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        held.append(resp)
        # The first-token mark races the next decision otherwise, and a changed
        # candidate is passed over by the reserve script (by design).
        await wait_for(partial(decoding, node, marked), what="first token marked")
    assert [r.headers["X-Instance-Id"] for r in held] == ["e0", "e0"]
    status, view = await call(harness, "GET", node.control_url + "/debug/instance_loads")
    assert status == 200
    # Nothing changed in between: the same pressure, scores and order must come out.
    coordinator = node.coordinator
    snapshot = await coordinator.snapshot()
    ranking = coordinator.rank(snapshot, view["strategy"])
    held_tokens = await coordinator.prefix.index_tokens([(r.id, r.epoch) for r in snapshot.rows])
    expected = instance_loads_view(
        snapshot,
        ranking,
        coordinator.settings,
        coordinator.node_id,
        coordinator.pool,
        None,
        coordinator.prefix.last_lookup,
        held_tokens,
    )
    assert view["generated_at"] <= expected["generated_at"]
    assert _absolute(view) == _absolute(expected)
    rows = {row["id"]: row for row in view["instances"]}
    assert rows["e0"]["inflight"] == 2 and rows["e0"]["rank"] == 0
    # inflight 2 + engine_running 0 + engine_waiting 1 x 0.25 + active_decode 2 x 0.5 (the
    # default timing turns the predicted layer on; no prefill is pending, no backlog)
    assert rows["e0"]["least_load_score"]["total"] == pytest.approx(3.25)
    assert rows["e0"]["least_load_score"]["sources"]["instantaneous"] == "hints"
    assert rows["e2"]["hints"]["engine_running"]["value"] == 40
    assert view["node_id"] == coordinator.node_id and view["pool"] == coordinator.pool
    assert view["coordination"] == "ok" and view["weights"]["inflight"] == 1.0
    for engine in engines:
        engine.gate.set()
    for resp in held:
        async with resp:
            await resp.read()
    await wait_for(lambda: settled(coordinator), what="counters back to 0")


async def test_debug_instance_loads_shows_the_best_first_within_a_limit(harness: Harness) -> None:
    node = await harness.node()
    base = node.control_url + "/v1/instances"
    for i in range(5):  # e0 least busy ... e4 busiest, by its engine's running requests
        assert (await call(harness, "POST", base, {"id": f"e{i}", "url": "http://127.0.0.1:9"}))[
            0
        ] == 201
        assert (await call(harness, "POST", f"{base}/e{i}/heartbeat", {"engine_running": 10 * i}))[
            0
        ] == 200
    url = node.control_url + "/debug/instance_loads"
    status, whole = await call(harness, "GET", url)
    assert status == 200 and whole["truncated"] is False
    assert [row["rank"] for row in whole["instances"]] == [0, 1, 2, 3, 4]
    summary = {"instances": 5, "alive": 5, "ejected": 0, "cordoned": 0, "inflight": 0}
    assert whole["summary"] == summary
    status, best = await call(harness, "GET", url + "?limit=2")
    assert status == 200 and best["truncated"] is True and best["summary"] == summary
    assert [row["id"] for row in best["instances"]] == ["e0", "e1"]
    ranked = [(r["id"], r["rank"], r["least_load_score"]) for r in whole["instances"]]
    assert [(r["id"], r["rank"], r["least_load_score"]) for r in best["instances"]] == ranked[:2]
    status, some = await call(harness, "GET", url + "?instance=e4&instance=e2&instance=nope")
    assert status == 200 and some["truncated"] is False
    assert [row["id"] for row in some["instances"]] == ["e2", "e4"]
    for bad in ("0", "x", "100001"):
        status, doc = await call(harness, "GET", url + "?limit=" + bad)
        assert status == 400 and doc["error"]["code"] == "invalid_limit", doc


async def test_reading_instance_loads_never_steers_routing(harness: Harness) -> None:
    """The view previews the next decision's ranking: reading it advances no rotation."""
    node = await harness.node()
    coordinator = node.coordinator
    for i in range(4):
        await coordinator.register_instance(InstanceSpec(id=f"e{i}", url="http://127.0.0.1:9"))
    url = node.control_url + "/debug/instance_loads?strategy=round_robin"
    choices = []
    for _ in range(6):
        views = [(await call(harness, "GET", url))[1] for _ in range(3)]
        previews = {next(r["id"] for r in v["instances"] if r["rank"] == 0) for v in views}
        snap = await coordinator.snapshot()
        choice = coordinator.rank(snap, "round_robin").choice
        assert choice is not None and previews == {choice.id}
        choices.append(choice.id)
    first = int(choices[0][1:])
    assert choices == [f"e{(first + k) % 4}" for k in range(6)]  # one turn per decision


async def test_debug_reservations_lists_numbers_not_payloads(harness: Harness) -> None:
    engine = await harness.engine(gate_after=1)
    node = await harness.node()
    await call(harness, "POST", node.control_url + "/v1/instances", {"id": "e0", "url": engine.url})
    resp = await harness.http.post(
        node.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "rid-7"}
    )
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    rows: list[dict[str, Any]] = []

    async def marked() -> bool:  # the first-token mark rides on a later call (carry_ms)
        status, doc = await call(harness, "GET", node.control_url + "/debug/reservations")
        assert status == 200 and doc["truncated"] is False
        rows[:] = doc["reservations"]
        return len(rows) == 1 and rows[0]["phase"] == "decode"

    await wait_for(marked, what="the reservation in phase decode")
    [row] = rows
    assert set(row) == {"rid", "instance", "node", "phase", "epoch", "age_ms"}
    # The client's X-Request-Id is echoed; the reservation id is the node's own.
    assert resp.headers["X-Request-Id"] == "rid-7"
    rid = resp.headers["X-Reservation-Id"]
    assert (row["rid"], row["instance"], row["node"]) == (rid, "e0", node.coordinator.node_id)
    assert row["age_ms"] >= 0
    assert (await call(harness, "GET", node.control_url + "/debug/reservations?limit=0"))[0] == 400
    engine.gate.set()
    async with resp:
        await resp.read()
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def test_engine_metrics_are_scraped_into_hints(harness: Harness) -> None:
    engine = await harness.engine(
        metrics_text=(
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m",engine="0"} 2\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="m"} 4\n'
        )
    )
    node = await harness.node(scrape_interval_s=0.05)
    await call(harness, "POST", node.control_url + "/v1/instances", {"id": "e0", "url": engine.url})

    async def scraped() -> bool:
        row = (await node.coordinator.snapshot()).by_id()["e0"]
        return (row.engine_running, row.engine_waiting) == (3.0, 4.0)

    await wait_for(scraped, what="hints scraped from the engine's /metrics")


async def test_two_nodes_split_the_scraping_by_rendezvous(harness: Harness) -> None:
    metrics = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
    engines = [await harness.engine(metrics_text=metrics) for _ in range(6)]
    nodes = [await harness.node(scrape_interval_s=0.05) for _ in range(2)]
    node_ids = [n.coordinator.node_id for n in nodes]
    for i, engine in enumerate(engines):
        await nodes[0].coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url))

    async def both_leases() -> bool:
        snap = await nodes[0].coordinator.snapshot()
        return sorted(await live_node_ids(nodes[0].coordinator, snap.now_ms)) == sorted(node_ids)

    await wait_for(both_leases, what="both node leases")
    for engine in engines:
        engine.scraped_by.clear()
    await wait_for(
        lambda: all(len(e.scraped_by) >= 5 for e in engines), what="five scrapes of every engine"
    )
    for i, engine in enumerate(engines):
        # A node's round in flight when the other lease appeared (at most one per
        # node) may still scrape with the old view: the scrapes after those are clean.
        assert set(engine.scraped_by[2:]) == {rendezvous_owner(f"e{i}", node_ids)}, i


async def test_a_scrape_round_keeps_a_bounded_number_of_engines_in_flight(
    harness: Harness,
) -> None:
    """150 engines are scraped 64 at a time, not all at once (10,000 at once stalled
    the event loop for a second), and every one is still scraped and stored."""
    metrics = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
    in_flight, most, full = [0], [0], asyncio.Event()

    async def scrape(request: web.Request) -> web.Response:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        if in_flight[0] >= hints.MAX_CONCURRENT_SCRAPES:
            full.set()
        # Each holds until as many as a round may run are in flight: with the bound,
        # exactly that many; without it, all of them.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(full.wait(), 5)
        in_flight[0] -= 1
        return web.Response(text=metrics)

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    async with served(app) as url:
        coordinator = await harness.coordinator()
        for i in range(150):
            await coordinator.register_instance(InstanceSpec(id=f"e{i:03d}", url=url))
        stored = await hints.scrape_once(coordinator, harness.http, 10.0)
        assert most[0] == hints.MAX_CONCURRENT_SCRAPES < 150
        assert stored == 150
        await coordinator.refresh(live=True)
        assert {row.engine_running for row in (await coordinator.snapshot()).rows} == {3.0}


async def test_scrape_owners_are_hashed_once_per_set_of_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[str] = []

    def counted(instance_id: str, node_ids: Sequence[str]) -> str:
        hashed.append(instance_id)
        return rendezvous_owner(instance_id, node_ids)

    monkeypatch.setattr(hints, "rendezvous_owner", counted)
    rows = [SimpleNamespace(id=f"i{k}", alive=k != 7) for k in range(100)]
    share = hints.ScrapeShare()

    async def mine(nodes: list[str], node: str = "a") -> set[str]:
        return {row.id for row in await share.mine(rows, nodes, node)}  # type: ignore[arg-type]

    first = await mine(["a", "b"])
    assert len(hashed) == 99 and "i7" not in hashed  # alive ones only
    expected = {
        f"i{k}" for k in range(100) if k != 7 and rendezvous_owner(f"i{k}", ["a", "b"]) == "a"
    }
    assert first == expected
    assert await mine(["b", "a"]) == first and len(hashed) == 99  # remembered
    rows.append(SimpleNamespace(id="new", alive=True))
    await mine(["a", "b"])
    assert len(hashed) == 100  # only the new one hashed
    assert await mine(["a"]) == {row.id for row in rows if row.alive}
    assert len(hashed) == 200  # the live nodes changed: every owner again


def test_engine_metric_parsing() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        "sglang:num_running_reqs 5\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        "sglang:num_queue_reqs 0\n"
        "# TYPE other_metric gauge\n"
        "other_metric 9\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        "vllm:num_requests_waiting NaN\n"
    )
    assert parse_engine_metrics(text) == {"engine_running": 5.0, "engine_waiting": 0.0}
    assert parse_engine_metrics("") == {}


def test_engine_metric_parsing_reads_only_the_hint_families() -> None:
    """A large exposition is parsed in its hint lines alone: a histogram-heavy body, a
    line the Prometheus parser refuses elsewhere, and a longer name sharing a hint's
    prefix change nothing."""
    histogram = "".join(
        f'vllm:e2e_seconds_bucket{{le="{2**k}",model_name="m"}} {k}\n' for k in range(30)
    )
    text = (
        "# HELP vllm:e2e_seconds e2e\n# TYPE vllm:e2e_seconds histogram\n"
        + histogram
        + "# HELP vllm:num_requests_running Number of requests running.\r\n"
        + "# TYPE vllm:num_requests_running gauge\r\n"
        + 'vllm:num_requests_running{engine="0",model_name="m"} 4.0\r\n'
        + 'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        + "vllm:num_requests_running_peak 100\n"
        + "vllm:num_requests_waiting 1\n"
    )
    assert parse_engine_metrics(text) == {"engine_running": 6.0, "engine_waiting": 1.0}
    assert parse_engine_metrics("this line is { not prometheus\n" + text) == {
        "engine_running": 6.0,
        "engine_waiting": 1.0,
    }


def test_rendezvous_gives_each_instance_one_owner_and_moves_little() -> None:
    nodes = ["node-a", "node-b", "node-c"]
    instances = [f"i{k}" for k in range(300)]
    owners = {i: rendezvous_owner(i, nodes) for i in instances}
    share = {n: sum(1 for o in owners.values() if o == n) for n in nodes}
    assert all(60 <= count <= 140 for count in share.values()), share
    # Order of the node list does not matter: every node computes the same owner.
    assert owners == {i: rendezvous_owner(i, list(reversed(nodes))) for i in instances}
    # A node leaving moves only its own instances.
    after = {i: rendezvous_owner(i, ["node-a", "node-c"]) for i in instances}
    moved = [i for i in instances if after[i] != owners[i]]
    assert moved and all(owners[i] == "node-b" for i in moved)


def test_the_node_defaults_are_the_library_policy() -> None:
    """One place holds the passive-health defaults: the node's flags take them."""
    assert NodeConfig().outlier_policy == OutlierPolicy()


def test_config_from_env_and_validation() -> None:
    env = {
        "REDIS_URL": "redis://10.0.0.1:6379/0",
        "COORD_POOL": "llama",
        "COORD_PORT": "9001",
        "COORD_CONTROL_PORT": "9002",
        "COORD_INSTANCES": "http://10.0.0.5:8000, http://10.0.0.6:8000",
        "COORD_TOKEN": "t",
        "COORD_STRATEGY": "round_robin",
        "COORD_SCRAPE_INTERVAL_S": "0",
        "COORD_LEASE_MS": "6000",
    }
    config = NodeConfig.from_env(env)
    assert config.redis_url == "redis://10.0.0.1:6379/0"
    assert (config.pool, config.port, config.control_port) == ("llama", 9001, 9002)
    assert config.instances == ("http://10.0.0.5:8000", "http://10.0.0.6:8000")
    assert (config.token, config.strategy, config.scrape_interval_s) == ("t", "round_robin", 0.0)
    assert config.settings.lease_ms == 6000
    over = NodeConfig.from_env(
        {**env, "COORD_REDIS_URL": "rediss://u:p@h:1/0"}, port=7, strategy="power_of_two"
    )
    assert (over.redis_url, over.port, over.strategy) == ("rediss://u:p@h:1/0", 7, "power_of_two")
    for bad in (
        {"COORD_PORT": "eighty"},
        {"COORD_PORT": "70000"},
        {"COORD_POOL": "{x}"},
        {"COORD_MAX_BODY_BYTES": "0"},
        {"COORD_REQUEST_TIMEOUT_S": "-1"},
        {"COORD_INSTANCES": "10.0.0.5:8000"},
        {"COORD_REDIS_URL": "http://x"},
        {"COORD_NODE_ID": "a b"},
        {"COORD_STRATEGY": "random"},
    ):
        with pytest.raises(InvalidArgumentError):
            NodeConfig.from_env(bad)
    assert instance_id_for("http://10.0.0.5:8000/") == "10.0.0.5:8000"
    assert instance_id_for("https://engine.local") == "engine.local:443"
    assert instance_id_for("http://[::1]:9000") == "i::1:9000"


def test_serve_help_names_every_environment_variable() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(out.getvalue().split())
    for name in (
        "COORD_REDIS_URL",
        "REDIS_URL",
        "COORD_POOL",
        "COORD_PORT",
        "COORD_CONTROL_PORT",
        "COORD_INSTANCES",
        "COORD_TOKEN",
        "COORD_STRATEGY",
        "COORD_NODE_ID",
        "COORD_MAX_BODY_BYTES",
        "COORD_REQUEST_TIMEOUT_S",
        "COORD_SCRAPE_INTERVAL_S",
        "COORD_LEASE_MS",
        "COORD_INSTANCE_TTL_MS",
    ):
        assert name in text, name


async def test_serve_command_end_to_end(harness: Harness) -> None:
    engine = await harness.engine(chunks=2)
    port, control_port = free_port(), free_port()
    env = {**os.environ, "COORD_TOKEN": "tok", "COORD_SCRAPE_INTERVAL_S": "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "coordinator_cli.main",
        "serve",
        "--redis-url",
        harness.redis_url,
        "--pool",
        harness.pool,
        "--port",
        str(port),
        "--control-port",
        str(control_port),
        "--instance",
        engine.url,
        "--node-id",
        "cli-node",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        async def up() -> bool:
            try:
                status, doc = await call(harness, "GET", url + "/healthz")
            except aiohttp.ClientError:
                return False
            return status == 200 and doc["alive_instances"] == 1

        await wait_for(up, timeout_s=15, what="the serve command to answer")
        async with harness.http.post(url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert resp.headers["X-Instance-Id"] == instance_id_for(engine.url)
            assert b"[DONE]" in await resp.read()
        base = f"http://127.0.0.1:{control_port}/v1/instances"
        assert (await call(harness, "POST", base, {"id": "x", "url": "http://h:1"}))[0] == 401
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if proc.stderr is not None:
            await proc.stderr.read()


@pytest.mark.real
async def test_a_node_warns_at_start_when_redis_may_evict_pool_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def warned() -> bool:
        return any("may evict any key" in r.getMessage() for r in caplog.records)

    with private_server() as server:
        harness = Harness(server.url, "evicting")
        admin = Redis.from_url(server.url)
        try:
            with caplog.at_level(logging.WARNING, logger="proxy_node.app"):
                await harness.node()  # the server's default: noeviction
                assert not warned()
                await admin.config_set("maxmemory", "100mb")
                await admin.config_set("maxmemory-policy", "allkeys-lru")
                await harness.node()
        finally:
            await harness.close()
            await admin.aclose()
    assert warned()
    assert any("allkeys-lru" in r.getMessage() for r in caplog.records)
