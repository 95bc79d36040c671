"""Prefix affinity through a node: the follow-up turn goes where its prefix is cached,
and the X-Prefix-Cached-Tokens header and /debug/instance_loads say how much."""

from __future__ import annotations

import json
from typing import Any

from coordinator.prefix import block_hashes, canonical_prompt, salt_key
from tests.fake_engine import Harness, NodeServer
from tests.helpers import wait_for

BLOCK = 64  # characters per prefix block on these nodes (16 tokens)
TIMING = {"prefill_ms_per_token": 0.1, "prefill_overhead_ms": 5.0, "decode_ms_per_token": 2.0}
SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 30}
TURN1 = [SYSTEM, {"role": "user", "content": "How many engines are there?"}]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "Three."},
    {"role": "user", "content": "Which one is the busiest?"},
]


async def fleet(harness: Harness, **settings: Any) -> NodeServer:
    coordinator = await harness.coordinator(prefix_block_chars=BLOCK, **settings)
    node = await harness.node(coordinator)
    for i in range(3):
        engine = await harness.engine()
        spec = {"id": f"e{i}", "url": engine.url, **TIMING}
        async with harness.http.post(node.control_url + "/v1/instances", json=spec) as resp:
            assert resp.status == 201
    return node


async def chat(harness: Harness, node: NodeServer, messages: list[Any]) -> tuple[str, str]:
    body = {"model": "fake-model", "messages": messages, "max_tokens": 2}
    async with harness.http.post(node.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Instance-Id"], resp.headers["X-Prefix-Cached-Tokens"]


async def test_a_follow_up_turn_goes_to_the_instance_holding_its_prefix(
    harness: Harness,
) -> None:
    node = await fleet(harness)
    prefix = node.coordinator.prefix
    first, cached = await chat(harness, node, TURN1)
    assert cached == "0"
    turn1_hashes = prefix.hashes({"messages": TURN1})
    assert len(turn1_hashes) > 10

    async def settled() -> bool:
        # Turn 1 recorded in the index and released (both are spawned), and its
        # predicted prefill over: a user types the next turn long after that.
        held = await prefix.cached_tokens(turn1_hashes)
        rows = (await node.coordinator.snapshot()).by_id()
        return bool(held) and all(r.predicted_total_backlog_ms == 0 for r in rows.values())

    await wait_for(settled, what="turn 1 recorded, released and its prefill over")
    second, cached = await chat(harness, node, TURN2)
    # Every whole block of turn 1 starts turn 2 as well (16 tokens per block).
    expected = len(turn1_hashes) * BLOCK // 4
    assert (second, cached) == (first, str(expected))

    view: dict[str, Any] = {}

    async def turn2_recorded() -> bool:
        # The index holds turn 2's blocks for that instance once its record went (it
        # rides on the node's next call, or goes by itself after carry_ms).
        async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
            view.update(json.loads(await resp.read()))
        rows = {row["id"]: row["prefix"] for row in view["instances"]}
        return rows[first]["index_tokens"] == len(prefix.hashes({"messages": TURN2})) * BLOCK // 4

    await wait_for(turn2_recorded, what="turn 2 recorded in the index")
    assert view["prefix_affinity"] is True
    rows = {row["id"]: row["prefix"] for row in view["instances"]}
    assert rows[first]["expected_cached_tokens"] == expected
    assert all(rows[other]["index_tokens"] == 0 for other in rows if other != first)


async def test_affinity_off_looks_nothing_up_and_records_nothing(harness: Harness) -> None:
    node = await fleet(harness, prefix_affinity=False)
    for messages in (TURN1, TURN2):
        _, cached = await chat(harness, node, messages)
        assert cached == "0"
    redis = node.coordinator.redis
    assert not await redis.exists(node.coordinator.keys.prefix_index())


def test_the_node_hashes_the_canonical_prompt_with_the_pool_salt() -> None:
    # What the index stores for a request: salted chained hashes of its canonical
    # prompt, the same function the mock engine uses for its own cache.
    text = canonical_prompt({"messages": TURN1})
    assert block_hashes(text, salt_key("p", ""), BLOCK, 128) != block_hashes(
        text, salt_key("p", "deployment secret"), BLOCK, 128
    )
