"""bench/soak.py's reads of the pool and its doc section.

The soak once read counters from per-column hashes that the packed `state` records
had replaced, so every invariant check of a long soak reported a violation and its
leak check summed nothing. Its reader and its check (coordinator/invariants.py,
through the same decoding client) are read here on a real pool, with a counter
broken by hand. It also once rewrote all of docs/reliability.md from a stale copy of
the page's head; it now writes only between its markers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bench.soak import RESULTS_START, load_embedded, main, read_pool_state
from coordinator.invariants import pool_problems
from coordinator.keys import PoolKeys
from coordinator.packed import STATE_BYTES
from tests.fake_engine import Harness
from tests.helpers import spec

pytestmark = pytest.mark.timeout(60)


async def test_the_soak_reads_the_counters_as_stored(
    harness: Harness, real_client: Redis, pool: str
) -> None:
    c = await harness.coordinator()
    for i in range(2):
        await c.register_instance(spec(i))
    held = [await c.reserve(100, 10) for _ in range(3)]
    await c.mark_first_token(held[0].rid)
    keys = PoolKeys("lc", pool)

    counters, records = await read_pool_state(real_client, keys)
    assert set(records) == {r.rid for r in held}
    assert set(counters["inflight"]) == {"i0", "i1"}
    assert sum(counters["inflight"].values()) == 3
    assert sum(counters["active_decode"].values()) == 1
    assert await pool_problems(real_client, keys) == []

    slot = int(await real_client.hget(keys.column("slot"), held[1].instance_id))
    await real_client.setrange(keys.column("state"), slot * STATE_BYTES, "\0" * 6)
    found = await pool_problems(real_client, keys)
    assert any(problem.startswith(f"{held[1].instance_id}: state") for problem in found), found


def test_rerender_rewrites_only_the_soak_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
    summary = load_embedded(ours)  # the documented run's results
    summary["command"] = "python bench/soak.py --a-marked-run"
    head, tail = "# Reliability\n\nEvery other section.\n\n", "\n\n## After the soak\n"
    doc = tmp_path / "reliability.md"
    embedded = f"{RESULTS_START}\n{json.dumps(summary)}\n```"
    doc.write_text(f"{head}<!-- soak:start -->\nan older run\n{embedded}\n<!-- soak:end -->{tail}")

    assert main(["--rerender", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(head) and text.endswith(tail)
    assert text.count("<!-- soak:start -->") == text.count("<!-- soak:end -->") == 1
    assert "python bench/soak.py --a-marked-run" in text and "an older run" not in text
    assert "re-rendered the soak section" in capsys.readouterr().out
