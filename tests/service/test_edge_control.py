"""Liveness, static instances and the control plane's rules (issue 14 items 2, 4, 10).

Liveness means the engine answers: a /metrics scrape stores hints but never keeps an
instance alive, and a static instance is heartbeated only while its engine answers
GET /v1/models. A registration cannot move a static instance; moving any instance to
another URL is an explicit, authenticated, logged act; a tokenless control plane only
listens on loopback.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from coordinator.errors import InvalidArgumentError
from proxy_node.config import NodeConfig, instance_id_for, is_loopback, normalize_instance_url
from proxy_node.serve import add_arguments, config_from_args
from tests.fake_engine import Harness, NodeServer
from tests.helpers import wait_for
from tests.service.test_proxy_forwarding import CHAT, post

pytestmark = pytest.mark.timeout(60)

FAST = {"instance_ttl_ms": 600, "heartbeat_interval_ms": 100}  # liveness in well under 1 s
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def instances(harness: Harness, node: NodeServer) -> dict[str, dict[str, Any]]:
    url = node.control_url + "/v1/instances?include_dead=true"
    async with harness.http.get(url) as resp:
        return {row["id"]: row for row in (await resp.json())["instances"]}


async def alive(harness: Harness, node: NodeServer, instance: str) -> bool:
    return bool((await instances(harness, node)).get(instance, {}).get("alive"))


async def health(harness: Harness, node: NodeServer) -> dict[str, Any]:
    async with harness.http.get(node.url + "/healthz") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


async def register(
    harness: Harness, node: NodeServer, body: dict[str, Any], query: str = "", token: bool = True
) -> tuple[int, dict[str, Any]]:
    async with harness.http.post(
        node.control_url + "/v1/instances" + query, json=body, headers=AUTH if token else {}
    ) as resp:
        return resp.status, await resp.json()


# ---------------------------------------------------------------------- liveness


async def test_a_hint_scrape_does_not_keep_a_silent_engine_alive(harness: Harness) -> None:
    engine = await harness.engine(metrics_text="vllm:num_requests_running 3\n")
    coordinator = await harness.coordinator(**FAST)
    node = await harness.node(coordinator, scrape_interval_s=0.05)
    assert (await register(harness, node, {"id": "e0", "url": engine.url}))[0] == 201

    async def scraped() -> bool:
        return len(engine.scraped_by) >= 2

    await wait_for(scraped, what="the node to scrape the engine")
    # No heartbeat follows the registration: the instance dies after its TTL even
    # though its /metrics keeps answering (and its hints keep being stored).
    await wait_for(lambda: _not(alive(harness, node, "e0")), what="e0 to stop being alive")
    scrapes = len(engine.scraped_by)
    assert (await health(harness, node))["alive_instances"] == 0
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 503
    assert len(engine.scraped_by) >= scrapes


async def _not(value: Any) -> bool:
    return not await value


async def test_a_static_engine_that_stops_answering_stops_being_alive(harness: Harness) -> None:
    engine = await harness.engine()
    coordinator = await harness.coordinator(**FAST)
    node = await harness.node(coordinator, instances=(engine.url,))
    iid = instance_id_for(engine.url)
    await wait_for(lambda: alive(harness, node, iid), what="the static instance alive")
    assert (await health(harness, node))["alive_instances"] == 1
    await engine.stop()
    await wait_for(lambda: _not(alive(harness, node, iid)), what="the stopped engine dead")
    assert (await health(harness, node))["alive_instances"] == 0


async def test_a_static_instance_gets_its_model_name(harness: Harness) -> None:
    engine = await harness.engine(model="served-model")
    node = await harness.node(instances=(engine.url + "/v1",))  # normalized
    row = (await instances(harness, node))[instance_id_for(engine.url)]
    assert (row["model"], row["url"], row["alive"]) == ("served-model", engine.url, True)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 200  # not /v1/v1/chat/completions
    other = await harness.engine(model="ignored")
    named = await harness.node(instances=(other.url,), instance_model="from-flag")
    assert (await instances(harness, named))[instance_id_for(other.url)]["model"] == "from-flag"


def test_instance_urls_are_normalized_or_refused() -> None:
    assert normalize_instance_url("http://h:8000/v1") == "http://h:8000"
    assert normalize_instance_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_instance_url("https://gw/engine-1/v1") == "https://gw/engine-1"
    assert normalize_instance_url("http://h:8000/") == "http://h:8000"
    for bad in ("h:8000", "ftp://h", "http://h:8000/v1?x=1", "http://u:p@h:1", "http://h:99999"):
        with pytest.raises(InvalidArgumentError, match="instance URL"):
            NodeConfig(instances=(bad,))
    assert NodeConfig(instances=("http://h:1/v1",)).instances == ("http://h:1",)


# ---------------------------------------------------------------------- control plane


def test_a_tokenless_control_plane_only_binds_loopback() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host)
        NodeConfig(host=host)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.internal"):
        assert not is_loopback(host)
        with pytest.raises(InvalidArgumentError, match="without a token"):
            NodeConfig(host=host)
        NodeConfig(host=host, token=TOKEN)
        NodeConfig(host=host, insecure_open_control_plane=True)
        NodeConfig(host=host, control_host="127.0.0.1")  # only the control plane matters
    with pytest.raises(InvalidArgumentError, match="without a token"):
        NodeConfig(control_host="0.0.0.0")
    env = {"COORD_HOST": "0.0.0.0", "COORD_INSECURE_OPEN_CONTROL_PLANE": "1"}
    assert NodeConfig.from_env(env).insecure_open_control_plane is True


def test_serve_flags_cover_the_new_knobs() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for flag in (
        "--connect-timeout-s",
        "--first-byte-timeout-s",
        "--idle-timeout-s",
        "--header-timeout-s",
        "--max-connections",
        "--drain-timeout-s",
        "--eject-consecutive-failures",
        "--eject-failure-window-s",
        "--eject-base-s",
        "--eject-max-s",
        "--eject-max-percent",
        "--insecure-open-control-plane",
        "--instance-model",
        "--no-prefix-affinity",
    ):
        assert flag in text, flag
    args = parser.parse_args(["--host", "0.0.0.0", "--insecure-open-control-plane"])
    assert config_from_args(args).insecure_open_control_plane is True
    args = parser.parse_args(["--idle-timeout-s", "7", "--eject-max-percent", "20"])
    config = config_from_args(args)
    assert (config.idle_timeout_s, config.outlier_policy.max_ejection_percent) == (7.0, 20.0)
    # Affinity is on by default; the flag turns it off (over the environment too).
    assert config.settings.prefix_affinity is True
    args = parser.parse_args(["--no-prefix-affinity"])
    assert config_from_args(args).settings.prefix_affinity is False


async def test_a_registration_cannot_move_a_static_instance(harness: Harness) -> None:
    engine, attacker = await harness.engine(), await harness.engine()
    node = await harness.node(instances=(engine.url,), token=TOKEN)
    iid = instance_id_for(engine.url)
    for query in ("", "?change_url=true"):
        status, doc = await register(harness, node, {"id": iid, "url": attacker.url}, query)
        assert (status, doc["error"]["code"]) == (409, "static_instance")
    for _ in range(4):
        async with await post(harness, node, CHAT) as resp:
            assert (resp.status, resp.headers["X-Instance-Id"]) == (200, iid)
    assert attacker.requests == 0


async def test_moving_an_instance_is_explicit_authenticated_and_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = await harness.engine(), await harness.engine()
    node = await harness.node(token=TOKEN)
    assert (await register(harness, node, {"id": "e0", "url": old.url}))[0] == 201
    status, doc = await register(harness, node, {"id": "e0", "url": new.url})
    assert (status, doc["error"]["code"]) == (409, "url_change")
    status, _ = await register(harness, node, {"id": "e0", "url": new.url}, "?change_url=1", False)
    assert status == 401
    with caplog.at_level(logging.WARNING, logger="proxy_node.control"):
        status, _ = await register(harness, node, {"id": "e0", "url": new.url}, "?change_url=1")
    assert status == 201
    assert any("moved from" in r.getMessage() and new.url in r.getMessage() for r in caplog.records)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 200
    assert (old.requests, new.requests) == (0, 1)
    # Re-registering the same URL needs nothing special; an engine restarted elsewhere
    # declares itself with a higher epoch, which is explicit too (and logged).
    assert (await register(harness, node, {"id": "e0", "url": new.url, "epoch": 9}))[0] == 201
    with caplog.at_level(logging.WARNING, logger="proxy_node.control"):
        body = {"id": "e0", "url": old.url, "epoch": 10}
        assert (await register(harness, node, body))[0] == 201
    assert any("restarted, epoch 9 -> 10" in r.getMessage() for r in caplog.records)
    status, doc = await register(harness, node, {"id": "e1", "url": old.url + "/v1"})
    assert (status, doc["error"]["code"]) == (422, "invalid_instance")


async def test_the_static_node_restores_a_moved_instance(harness: Harness) -> None:
    engine, other = await harness.engine(), await harness.engine()
    coordinator = await harness.coordinator(**FAST)
    owner = await harness.node(coordinator, instances=(engine.url,))
    peer = await harness.node(token=TOKEN)  # another node, which does not serve it statically
    iid = instance_id_for(engine.url)
    status, _ = await register(harness, peer, {"id": iid, "url": other.url}, "?change_url=true")
    assert status == 201

    async def restored() -> bool:
        return (await instances(harness, owner))[iid]["url"] == engine.url

    await wait_for(restored, what="the owning node to restore its static instance's URL")
