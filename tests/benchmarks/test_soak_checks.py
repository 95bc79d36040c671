"""bench/soak.py's checks and its doc section.

The soak compares every counter with the live reservations every 2 s. It once read
counters from per-column hashes that the packed `state` records had replaced, so
every check of a long soak reported a violation (and its leak check summed nothing);
this reads a real pool through it, and breaks a counter to see the check fail. It
also once rewrote all of docs/reliability.md from a stale copy of the page's head;
it now writes only between its markers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bench.soak import RESULTS_START, Soak, load_embedded, main, read_pool_state
from coordinator.keys import PoolKeys
from coordinator.packed import STATE_BYTES
from tests.fake_engine import Harness
from tests.helpers import spec

pytestmark = pytest.mark.timeout(60)


async def test_the_soaks_check_reads_the_counters_as_stored(
    harness: Harness, real_client: Redis, pool: str
) -> None:
    c = await harness.coordinator()
    for i in range(2):
        await c.register_instance(spec(i))
    held = [await c.reserve(100, 10) for _ in range(3)]
    await c.mark_first_token(held[0].rid)
    keys = PoolKeys("lc", pool)

    counters, records, epochs = await read_pool_state(real_client, keys)
    assert set(records) == {r.rid for r in held}
    assert sum(counters["inflight"].values()) == 3
    assert sum(counters["active_decode"].values()) == 1
    assert Soak.inconsistencies(counters, records, epochs) == []

    slot = int(await real_client.hget(keys.column("slot"), held[1].instance_id))
    await real_client.setrange(keys.column("state"), slot * STATE_BYTES, "\0" * 6)
    found = Soak.inconsistencies(*await read_pool_state(real_client, keys))
    assert any(f"'{held[1].instance_id}': 0" in problem for problem in found), found


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
