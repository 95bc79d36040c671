"""Cordoning an engine instance: an operator's maintenance drain, through the control
plane and `coordinator cordon`. No new request goes to it; the ones in flight finish."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import pytest

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.connection import connect_redis
from tests.fake_engine import Harness, NodeServer, settled
from tests.helpers import private_server, wait_for
from tests.service.test_proxy_forwarding import metric

pytestmark = pytest.mark.timeout(60)

STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def hold(harness: Harness, node: NodeServer) -> aiohttp.ClientResponse:
    """A stream held by its engine after the first chunk."""
    resp = await harness.http.post(node.url + "/v1/chat/completions", json=STREAM)
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
    return resp


async def cordon(harness: Harness, node: NodeServer, iid: str, method: str = "POST") -> Any:
    url = f"{node.control_url}/v1/instances/{iid}/cordon"
    async with harness.http.request(method, url, json={"reason": "upgrade"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_a_cordoned_engine_finishes_its_streams_and_gets_no_new_ones(
    harness: Harness,
) -> None:
    engines = {f"e{i}": await harness.engine(gate_after=1) for i in range(2)}
    node = await harness.node()
    for iid, engine in engines.items():
        await node.coordinator.register_instance(InstanceSpec(id=iid, url=engine.url))
    held = [await hold(harness, node) for _ in range(4)]
    on = {resp.headers["X-Instance-Id"] for resp in held}
    assert on == {"e0", "e1"}  # least_load spread them
    answer = await cordon(harness, node, "e0")
    assert answer == {"instance_id": "e0", "cordoned": True, "reason": "upgrade", "inflight": 2}
    # e1 is the busier one, yet every new request goes there.
    held += [await hold(harness, node) for _ in range(3)]
    assert [resp.headers["X-Instance-Id"] for resp in held[4:]] == ["e1"] * 3
    async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
        view = await resp.json()
    rows = {row["id"]: row for row in view["instances"]}
    assert rows["e0"]["outlier"]["cordoned"] is True and rows["e0"]["rank"] is None
    assert rows["e0"]["outlier"]["cordon_reason"] == "upgrade"
    assert view["summary"]["cordoned"] == 1
    async with harness.http.get(node.url + "/healthz") as resp:
        assert (await resp.json())["cordoned_instances"] == 1
    assert await metric(harness, node.url, "proxy_instances_cordoned") == 1
    # The drained engine's streams end normally.
    engines["e0"].gate.set()
    for resp in [r for r in held if r.headers["X-Instance-Id"] == "e0"]:
        held.remove(resp)
        async with resp:
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")

    async def e0_drained() -> bool:
        rows = (await node.coordinator.snapshot()).by_id()
        return rows["e0"].inflight == 0

    await wait_for(e0_drained, what="e0 drained")
    # Back in rotation: the idle e0 takes the next request.
    assert (await cordon(harness, node, "e0", "DELETE"))["cordoned"] is False
    async with harness.http.post(node.url + "/v1/chat/completions", json=STREAM) as resp:
        assert resp.headers["X-Instance-Id"] == "e0"
        await resp.read()
    engines["e1"].gate.set()
    for resp in held:
        async with resp:
            await resp.read()
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def test_a_cordon_through_one_node_holds_on_every_node(harness: Harness) -> None:
    engines = [await harness.engine() for _ in range(2)]
    nodes = [await harness.node() for _ in range(2)]
    for i, engine in enumerate(engines):
        await nodes[0].coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url))
    await cordon(harness, nodes[0], "e0")

    async def other_node_knows() -> bool:
        async with harness.http.get(nodes[1].url + "/healthz") as resp:
            return bool((await resp.json())["cordoned_instances"] == 1)

    await wait_for(other_node_knows, what="the other node to read the cordon")
    for _ in range(4):
        async with harness.http.post(nodes[1].url + "/v1/chat/completions", json=STREAM) as resp:
            assert resp.headers["X-Instance-Id"] == "e1"
            await resp.read()
    assert engines[0].requests == 0


async def test_with_every_instance_cordoned_the_answer_is_503(harness: Harness) -> None:
    engine = await harness.engine()
    node = await harness.node()
    await node.coordinator.register_instance(InstanceSpec(id="e0", url=engine.url))
    url = f"{node.control_url}/v1/instances/e0/cordon"
    async with harness.http.post(url, json={"reason": "two\nlines"}) as resp:
        assert resp.status == 400  # printable text only: it reaches logs and views
    await cordon(harness, node, "e0")
    async with harness.http.post(node.url + "/v1/chat/completions", json=STREAM) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_instance"
    assert engine.requests == 0


async def ended(proc: asyncio.subprocess.Process) -> None:
    """Kill a command a failed assertion left running."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def read_until(proc: asyncio.subprocess.Process, wanted: str) -> None:
    """Read the command's output up to the line `wanted` (20 s per line at most)."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    while not lines or lines[-1] != wanted:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line, (lines, await proc.stderr.read())
        lines.append(line.decode().strip())


async def run_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "coordinator_cli.main",
        "cordon",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_the_cordon_command_waits_for_the_drain(
    harness: Harness, redis_url: str, pool: str
) -> None:
    coordinator = await harness.coordinator()
    await coordinator.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9"))
    res = await coordinator.reserve(100, 10)
    where = ("--redis-url", redis_url, "--pool", pool)
    proc = await run_cli("e0", *where, "--reason", "upgrade", "--wait", "30")
    try:
        await read_until(proc, "e0: 1 request(s) in flight")
        view = await coordinator.read_outliers()
        assert view.state("e0").cordon == "upgrade"
        await coordinator.release(res.rid)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err
        assert out.decode().splitlines()[-2:] == ["e0: 0 request(s) in flight", "e0: drained"]
    finally:
        await ended(proc)

    # A drain that does not end in time says so; a lift needs no wait.
    await coordinator.reserve(100, 10)
    proc = await run_cli("e0", *where, "--wait", "0.5")
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    # (never less than the time every node takes to learn of the cordon)
    assert proc.returncode == 1 and b"still holds 1 request(s) after 2 s" in err
    proc = await run_cli("e0", *where, "--lift")
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert (proc.returncode, out) == (0, b"e0: back in rotation\n")
    assert (await coordinator.read_outliers()).cordoned_ids() == frozenset()
    bad_uses = (
        (("nobody", *where), 1),
        (("e0", *where, "--lift", "--wait"), 2),
        (("e0", *where, "--reason", "two\nlines"), 2),
    )
    for bad, code in bad_uses:
        proc = await run_cli(*bad)
        await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == code, bad


async def test_the_wait_counts_requests_nodes_sent_before_they_learned_of_the_cordon(
    harness: Harness, redis_url: str, pool: str
) -> None:
    """A node learns of a cordon within a second and may reserve on the instance until
    then: `--wait` declares no drain before that time, so such a request is waited for."""
    late_node = await harness.coordinator()
    await late_node.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9"))
    proc = await run_cli("e0", "--redis-url", redis_url, "--pool", pool, "--wait", "30")
    try:
        await read_until(proc, "e0: 0 request(s) in flight")
        res = await late_node.reserve(100, 10)  # its view knows of no cordon yet
        assert res.instance_id == "e0" and proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.decode().strip() == "e0: 1 request(s) in flight"  # not "drained"
        await late_node.release(res.rid)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err
        assert out.decode().splitlines() == ["e0: 0 request(s) in flight", "e0: drained"]
    finally:
        await ended(proc)


async def test_the_wait_never_calls_a_drain_it_cannot_see(pool: str) -> None:
    """With Redis gone mid-wait, the requests in flight are unknown, not 0: the command
    keeps waiting, and says so when its time is up."""
    with private_server() as server:
        coordinator = Coordinator(connect_redis(server.url, Settings()), pool=pool, node_id="n")
        try:
            await coordinator.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9"))
            await coordinator.reserve(100, 10)
            proc = await run_cli("e0", "--redis-url", server.url, "--pool", pool, "--wait", "4")
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 20)
                assert line == b"e0: cordoned; nodes stop sending it requests within a second\n"
                line = await asyncio.wait_for(proc.stdout.readline(), 20)
                assert line == b"e0: 1 request(s) in flight\n"
                server.stop()
                out, err = await asyncio.wait_for(proc.communicate(), 30)
                assert proc.returncode == 1, (out, err)
                assert b"drained" not in out
                assert out == b"e0: requests in flight unknown (Redis unreachable)\n"
                assert b"still holds an unknown number of request(s)" in err
            finally:
                await ended(proc)
        finally:
            await coordinator.close()


async def test_without_redis_a_cordon_is_503_never_a_guess(pool: str) -> None:
    with private_server() as server:
        harness = Harness(server.url, pool)
        try:
            node = await harness.node()
            await node.coordinator.register_instance(
                InstanceSpec(id="e0", url="http://127.0.0.1:9")
            )
            server.stop()
            url = f"{node.control_url}/v1/instances/e0/cordon"
            async with harness.http.post(url, json={"reason": "upgrade"}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "coordination_unavailable"
        finally:
            await harness.close()
