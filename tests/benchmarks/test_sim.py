"""The discrete-event simulator: traces, utilization, determinism, the oracle, and
the in-memory shared state agreeing with the real Lua scripts."""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bench.live import load_slice
from bench.sim.report import markdown, run_trace
from bench.sim.shared_state import SharedState
from bench.sim.simulator import (
    STRATEGIES,
    SimConfig,
    Simulation,
    compare,
    exact_ttft_ms,
    percentile,
    simulate,
)
from bench.sim.synthetic import SyntheticWorkload, synthetic_requests
from bench.sim.traces import (
    TraceError,
    TraceRequest,
    load_trace,
    offered_load,
    parse_trace,
    scale_to_utilization,
)
from coordinator import Coordinator
from coordinator.packed import NO_SLOT, pack_candidate
from coordinator.pressure import instance_load
from coordinator_cli import bench as bench_cli
from local_fleet.engine_model import EngineModel, EngineTiming
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    live_reservations,
    packed_counters,
    spec,
)

BASE = datetime(2023, 11, 16, 18, 17, 3, 979960)


def synthetic(n: int, seed: int = 1) -> list[tuple[float, int, int]]:
    """(arrival ms, prompt, output) with bursty arrivals and skewed sizes."""
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(n):
        # Alternate calm and burst phases so the fleet sees real queueing.
        t += rng.expovariate(1 / (5.0 if (i // 40) % 2 else 60.0))
        prompt = int(rng.lognormvariate(6.5, 0.9))
        output = max(1, int(rng.lognormvariate(3.5, 1.0)))
        rows.append((round(t, 3), prompt, output))
    return rows


def write_csv(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for at, prompt, output in rows:
        stamp = (BASE + timedelta(milliseconds=at)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
        lines.append(f"{stamp},{prompt},{output}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": at, "input_length": p, "output_length": o}) + "\n"
            for at, p, o in rows
        )
    )
    return path


@pytest.fixture
def trace(tmp_path: Path) -> list[TraceRequest]:
    """400 synthetic requests scaled to a busy fleet of 4 instances."""
    reqs = load_trace(write_jsonl(tmp_path / "t.jsonl", synthetic(400)))
    return scale_to_utilization(reqs, EngineTiming(), 4, 0.85)


CONFIG = SimConfig(instances=4, nodes=3, hint_interval_ms=200.0, seed=7)

# ---------------------------------------------------------------------- traces


def test_both_formats_parse_to_the_same_requests(tmp_path: Path) -> None:
    rows = synthetic(50)
    from_csv = load_trace(write_csv(tmp_path / "t.csv", rows))
    from_jsonl = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    assert len(from_csv) == len(from_jsonl) == 50
    for a, b in zip(from_csv, from_jsonl, strict=True):
        assert (a.index, a.prompt_tokens, a.output_tokens) == (
            b.index,
            b.prompt_tokens,
            b.output_tokens,
        )
        assert a.arrival_ms == pytest.approx(b.arrival_ms, abs=1e-3)
    assert from_csv[0].arrival_ms == 0.0
    assert [r.prompt_tokens for r in from_csv] == [p for _, p, _ in rows]


def test_limit_sorting_and_zero_outputs(tmp_path: Path) -> None:
    text = (
        '{"timestamp": 500, "input_length": 3, "output_length": 4}\n\n'
        '{"timestamp": 100, "input_length": 1, "output_length": 0}\n'
        '{"timestamp": 300, "input_length": 2, "output_length": 2}\n'
    )
    reqs = parse_trace(text)
    assert [(r.arrival_ms, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 1, 1),  # generated nothing: still one forward pass
        (200.0, 2, 2),
        (400.0, 3, 4),
    ]
    assert [r.prompt_tokens for r in parse_trace(text, limit=2)] == [1, 3]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n", "t:2: output"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", "t:2: TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,-1,3\n", ">= 0"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,1\n", "3 columns"),
        ("time,prompt,output\n1,2,3\n", "t:1: expected the CSV header"),
        ('{"timestamp": 1, "input_length": 2}\n', "t:1: missing field(s) output_length"),
        ('{"timestamp": 1, "input_length": 2, "output_length": 3}\n{oops\n', "t:2: not a JSON"),
        ('{"timestamp": "x", "input_length": 2, "output_length": 3}\n', "timestamp must be"),
        ('{"timestamp": 1, "input_length": 2.5, "output_length": 3}\n', "input_length must"),
        ("   \n", "empty"),
    ],
)
def test_bad_rows_raise_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_trace(text, source="t")


def test_unreadable_trace_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize("target", [0.3, 0.8, 0.95])
def test_utilization_scaling_hits_its_target(tmp_path: Path, target: float) -> None:
    timing = EngineTiming()
    reqs = load_trace(write_csv(tmp_path / "t.csv", synthetic(300)))
    scaled = scale_to_utilization(reqs, timing, 4, target)
    assert [(r.prompt_tokens, r.output_tokens) for r in scaled] == [
        (r.prompt_tokens, r.output_tokens) for r in reqs
    ]
    # Recompute from first principles: prefill blocks the engine; each later token is
    # a 1/B share of a decode step at the nominal batch B = max_batch // 2.
    share = (timing.decode_base_ms + timing.decode_ms_per_seq * 16) / 16
    busy = sum(
        timing.prefill_overhead_ms
        + timing.prefill_ms_per_token * r.prompt_tokens
        + (r.output_tokens - 1) * share
        for r in scaled
    )
    span = scaled[-1].arrival_ms - scaled[0].arrival_ms
    achieved = (len(scaled) - 1) / span * (busy / len(scaled)) / 4
    assert achieved == pytest.approx(target, rel=1e-6)
    assert offered_load(scaled, timing, 4) == pytest.approx(target, rel=1e-9)


def test_utilization_needs_a_rate() -> None:
    same_time = [TraceRequest(i, 0.0, 10, 10) for i in range(3)]
    with pytest.raises(TraceError, match="same time"):
        scale_to_utilization(same_time, EngineTiming(), 4, 0.5)


# ---------------------------------------------------------------------- simulator


def test_every_request_completes_for_every_strategy(trace: list[TraceRequest]) -> None:
    for strategy in STRATEGIES:
        sim = Simulation(trace, strategy, CONFIG)
        result = sim.run()
        assert result.completed == result.requests == len(trace), strategy
        assert sum(result.assigned) == len(trace)
        assert all(not math.isnan(x) for x in sim.finished), strategy
        assert all(ttft >= 0 for ttft in result.ttft_ms)
        # Every reservation was released: the shared counters are back to zero.
        for row in sim.state.rows():
            assert (row.inflight, row.pending_prefill, row.active_decode) == (0, 0, 0)
            assert row.earliest_end_at_ms is None
        assert all(e.num_running == e.num_waiting == 0 for e in sim.engines)


def test_same_seed_same_results(trace: list[TraceRequest]) -> None:
    first = compare(trace, STRATEGIES, CONFIG)
    again = compare(trace, STRATEGIES, CONFIG)
    assert [r.as_dict() for r in first] == [r.as_dict() for r in again]
    assert [r.ttft_ms for r in first] == [r.ttft_ms for r in again]
    other = simulate(trace, "random", SimConfig(instances=4, nodes=3, seed=8))
    assert other.assigned != first[0].assigned  # the seed does reach the random choices


def test_oracle_is_never_worse_than_random(tmp_path: Path) -> None:
    for seed in (1, 2, 3):
        reqs = load_trace(write_jsonl(tmp_path / f"t{seed}.jsonl", synthetic(300, seed)))
        for util in (0.6, 0.95):
            scaled = scale_to_utilization(reqs, EngineTiming(), 4, util)
            cfg = SimConfig(instances=4, nodes=3, seed=seed)
            oracle, rand = compare(scaled, ["oracle", "random"], cfg)
            assert oracle.ttft_p99_ms <= rand.ttft_p99_ms, (seed, util)


def test_exact_ttft_matches_a_cloned_engine() -> None:
    """The oracle's shortcut equals stepping a copy of the engine to the first token."""
    rng = random.Random(5)
    for timing in (EngineTiming(), EngineTiming(max_batch=3, decode_base_ms=5.0)):
        engine = EngineModel(timing)
        unprefilled: list[tuple[str, int]] = []  # (rid, output) FCFS, as the simulator keeps
        now, checked = 0.0, 0
        for i in range(120):
            now += rng.expovariate(1 / 40.0)
            for ev in engine.advance(now):
                if ev.kind == "first_token":
                    assert unprefilled.pop(0)[0] == ev.rid
            current = unprefilled[0][1] if engine.num_running > len(engine.running) else None
            prompt = rng.randrange(0, 3000)
            probe = copy.deepcopy(engine)
            probe.submit("probe", prompt, 1, now)
            expected = None
            while expected is None:
                at = probe.next_event_ms()
                assert at is not None
                if any(e.rid == "probe" for e in probe.advance(at)):
                    expected = at - now
            assert exact_ttft_ms(engine, prompt, now, current) == pytest.approx(expected), i
            checked += 1
            output = rng.choice([1, 2, rng.randrange(1, 300)])
            engine.submit(f"r{i}", rng.randrange(0, 3000), output, now)
            unprefilled.append((f"r{i}", output))
        assert checked == 120


def test_percentile_interpolates() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_report_markdown_and_json(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", synthetic(120))
    run = run_trace(path, utilization=0.7, config=SimConfig(instances=4, seed=3))
    text = markdown(run, ["coordinator", "bench", "sim", "--trace", str(path)])
    assert text.count("\n| ") == 1 + len(STRATEGIES)  # header + one row per strategy
    assert "| oracle | " in text and "(1.00x)" in text
    assert "least_load TTFT p99 / oracle TTFT p99" in text
    data = run.as_dict()
    assert data["offered_utilization"] == pytest.approx(0.7)
    assert {r["strategy"] for r in data["results"]} == set(STRATEGIES)
    assert data["ratios_to_oracle"]["oracle"]["ttft_p99_ms"] == 1.0
    assert [t["vs"] for t in data["targets"]] == [
        "oracle",
        "local_least_inflight",
        "least_load_instantaneous",
    ]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", synthetic(80))
    args = bench_args(
        "sim",
        "--trace",
        str(path),
        "--instances",
        "4",
        "--strategies",
        "least_load,oracle",
        "--limit",
        "60",
        "--json",
        "--quiet",
        "--weights",
        "backlog_ms=0.05",
    )
    assert bench_cli.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in data["results"]] == ["least_load", "oracle"]
    assert all(r["completed"] == 60 for r in data["results"])
    assert data["config"]["weights"]["backlog_ms"] == 0.05


def test_cli_single_request_as_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [(5.0, 100, 3)])
    args = bench_args("sim", "--trace", str(path), "--utilization", "0", "--json", "--quiet")
    assert bench_cli.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["offered_utilization"] is None and data["utilization_target"] is None
    assert all(r["completed"] == 1 for r in data["results"])
    # Scaling one request to a utilization has no rate to scale: a clear error.
    assert bench_cli.run(bench_args("sim", "--trace", str(path), "--quiet")) == 2
    assert "at least 2 requests" in capsys.readouterr().err


def test_cli_markdown_progress_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_csv(tmp_path / "t.csv", synthetic(50))
    assert bench_cli.run(bench_args("sim", "--trace", str(path), "--strategies", "random")) == 0
    out, err = capsys.readouterr()
    assert "| random |" in out and "Regenerate: `coordinator bench sim --trace" in out
    assert "sim: random 100% (50/50)" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nnope,1,1\n")
    assert bench_cli.run(bench_args("sim", "--trace", str(bad), "--quiet")) == 2
    assert "bad.csv:2: TIMESTAMP" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_args("sim", "--trace", str(path), "--strategies", "fastest")


# ---------------------------------------------------------------------- the built-in workload


def test_synthetic_workload_is_seeded_and_has_its_documented_shape() -> None:
    workload = SyntheticWorkload()
    reqs = workload.requests(2000, seed=3)
    assert reqs == workload.requests(2000, seed=3)
    assert reqs != workload.requests(2000, seed=4)
    assert [r.index for r in reqs] == list(range(2000))
    arrivals = [r.arrival_ms for r in reqs]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    prompts = sorted(r.prompt_tokens for r in reqs)
    outputs = sorted(r.output_tokens for r in reqs)
    assert 16 <= prompts[0] and prompts[-1] <= 16_384
    assert 1 <= outputs[0] and outputs[-1] <= 2048
    # Medians near the documented 1,024 and 128 (seeded: the same numbers every run).
    assert 900 <= prompts[1000] <= 1150 and 110 <= outputs[1000] <= 145
    # Bursts: arrivals per second in burst windows are about 4x those in calm ones
    # (arrivals are re-based to the first one, a fraction of a second off the phase).
    burst = sum(workload.rate(r.arrival_ms / 1000) > workload.calm_rps for r in reqs)
    burst_time = workload.burst_s / (workload.calm_s + workload.burst_s)
    ratio = (burst / burst_time) / ((len(reqs) - burst) / (1 - burst_time))
    assert 3.0 <= ratio <= 5.0, ratio


def test_sim_cli_without_a_trace_runs_the_synthetic_workload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("sim", "--limit", "300", "--strategies", "least_load,oracle", "--quiet")
    assert bench_cli.run(bench_args(*argv, "--json")) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["trace"] is None and first["requests"] == 300
    assert all(r["completed"] == 300 for r in first["results"])
    assert bench_cli.run(bench_args(*argv, "--json")) == 0
    assert json.loads(capsys.readouterr().out) == first  # deterministic
    assert bench_cli.run(bench_args(*argv)) == 0
    out = capsys.readouterr().out
    assert "300 requests from the built-in synthetic workload (seed 0)" in out
    assert "Regenerate: `coordinator bench sim --utilization 0.8 --strategies" in out
    assert "--trace" not in out


def test_live_slice_without_a_trace_is_the_synthetic_workload() -> None:
    rows = load_slice(None, 100, 50, None, 4, seed=5)
    again = synthetic_requests(150, 5)[100:]
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [
        (r.prompt_tokens, r.output_tokens) for r in again
    ]
    assert rows[0].arrival_ms == 0 and [r.index for r in rows] == list(range(50))


# ---------------------------------------------------------------------- shared state vs Lua


async def lua_state(c: Any) -> dict[str, Any]:
    """Per-instance counters (the packed records) and reservation records, as stored."""
    stored = await packed_counters(c)
    counters = ("inflight", "pending_prefill", "active_decode", "pending_prefill_ms")
    cols = {name: stored[name] for name in (*counters, "prefill_free_at_ms")}
    ends: dict[str, int] = {}
    for member in await c.redis.zrange(c.keys.column("by_instance"), 0, -1):
        stem, end, _ = member.split("|", 2)
        iid = stem.rsplit("#", 1)[0]  # '<id>#<epoch>' (lua/_lib.lua lex_member)
        ends[iid] = min(ends.get(iid, int(end)), int(end))
    records = await live_reservations(c)
    for rec in records.values():
        rec.pop("slot")  # where Redis packs the counters: the sim has no slots
    return {"columns": cols, "earliest_end": ends, "records": records}


async def redis_now(c: Coordinator) -> int:
    """The Redis server's clock in ms."""
    seconds, micros = await c.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _free_after(state: SharedState, rid: str, now: int) -> int:
    """The sim's prefill cursor of `rid`'s instance after releasing it at `now` (a copy)."""
    trial = copy.deepcopy(state)
    iid = trial.reservation(rid).instance  # type: ignore[union-attr]
    trial.release(rid, now)
    return trial.row(iid).prefill_free_at_ms


def sim_state(state: SharedState, ids: list[str], rids: set[str]) -> dict[str, Any]:
    cols: dict[str, dict[str, int]] = {
        name: {}
        for name in (
            "inflight",
            "pending_prefill",
            "active_decode",
            "pending_prefill_ms",
            "prefill_free_at_ms",
        )
    }
    ends = {}
    for iid in ids:
        row = state.row(iid)
        cols["inflight"][iid] = row.inflight
        cols["pending_prefill"][iid] = row.pending_prefill
        cols["active_decode"][iid] = row.active_decode
        cols["pending_prefill_ms"][iid] = state.pending_prefill_ms(iid)
        cols["prefill_free_at_ms"][iid] = row.prefill_free_at_ms
        if row.earliest_end_at_ms is not None:
            ends[iid] = row.earliest_end_at_ms
    records = {}
    for rid in rids:
        rec = state.reservation(rid)
        if rec is not None:
            records[rid] = {
                "instance": rec.instance,
                "epoch": rec.epoch,
                "node": rec.node,
                "phase": rec.phase,
                "prompt_tokens": rec.prompt_tokens,
                "expected_output_tokens": rec.expected_output_tokens,
                "prefill_ms": rec.prefill_ms,
                "decode_ms": rec.decode_ms,
                "created_ms": rec.created_ms,
                "first_token_at_ms": rec.first_token_at_ms,
                "end_at_ms": rec.end_at_ms,
                "predicted_ttft_ms": rec.predicted_ttft_ms,
            }
    return {"columns": cols, "earliest_end": ends, "records": records}


async def test_shared_state_matches_the_lua_scripts(make_coordinator: MakeCoordinator) -> None:
    """The same reserve/mark_first_token/release sequence on Redis and in memory.

    The in-memory clock is set to the Redis time each script used, read back from what
    it stored (created_ms, first_token_at_ms, or the re-chained prefill cursor).
    """
    c = await make_coordinator("n1")
    ids = ["i0", "i1"]
    state = SharedState()
    for k, iid in enumerate(ids):
        s = spec(
            k,
            prefill_ms_per_token=0.5,
            prefill_overhead_ms=2.0,
            decode_ms_per_token=3.0,
            max_slots=3,
        )
        await c.register_instance(s)
        registered_at = int(await c.redis.hget(c.keys.column("last_seen_ms"), iid))
        state.register(s, registered_at)
    rng = random.Random(11)
    rids: set[str] = set()
    live: dict[str, str] = {}  # rid -> phase
    for step in range(70):
        op = rng.choice(["reserve", "reserve", "first", "release", "noop"])
        if op == "reserve" or not live:
            rid = f"r{step}"
            prompt, expected = rng.randrange(0, 60), rng.randrange(0, 20)
            res = await c.reserve(prompt, expected, strategy="round_robin", rid=rid)
            now = (await live_reservations(c))[rid]["created_ms"]
            status, rec = state.reserve(
                rid, "n1", res.instance_id, prompt, expected, res.prefill_ms, res.decode_ms, now
            )
            assert status == "ok" and rec.predicted_ttft_ms == res.predicted_ttft_ms
            rids.add(rid)
            live[rid] = "prefill"
        elif op == "first":
            rid = rng.choice(sorted(live))
            done = await c.mark_first_token(rid)
            assert done == (live[rid] == "prefill")
            now = (await live_reservations(c))[rid]["first_token_at_ms"] if done else 0
            assert state.mark_first_token(rid, now) == done
            live[rid] = "decode"
        elif op == "release":
            rid = rng.choice(sorted(live))
            iid = state.reservation(rid).instance  # type: ignore[union-attr]
            before = await redis_now(c)
            assert await c.release(rid)
            after = await redis_now(c)
            free = (await packed_counters(c))["prefill_free_at_ms"][iid]
            # A decode-phase release stores no time; a prefill one re-chains from the
            # script's `now`, somewhere between the two reads: the sim must agree with
            # Redis for one of those times.
            now = 0
            if live.pop(rid) == "prefill":
                now = next(
                    (t for t in range(before, after + 1) if _free_after(state, rid, t) == free),
                    before,
                )
            assert state.release(rid, now)
        else:
            rid = rng.choice(sorted(rids))
            assert await c.release(f"gone{step}") is False
            assert state.release(f"gone{step}", 0) is False
            again = await c.reserve(1, 1, rid=rid) if rid in live else None
            if again is not None:  # a repeated rid is a dup: same claim, nothing moves
                status, rec = state.reserve(rid, "n1", again.instance_id, 1, 1, 0, 0, 0)
                assert status == "dup" and rec.instance == again.instance_id
        assert sim_state(state, ids, rids) == await lua_state(c), (step, op)
        await assert_counters_match_reservations(c)
        # And the pressure derived from either is the same at the snapshot's time.
        snap = await c.snapshot()
        for load in snap.rows:
            mine = instance_load(
                state.row(load.id), snap.now_ms, instance_ttl_ms=10**9, hint_ttl_ms=0
            )
            assert (
                mine.inflight,
                mine.pending_prefill_count,
                mine.active_decode_count,
                mine.prefill_free_in_ms,
                mine.next_slot_ready_in_ms,
                mine.predicted_total_backlog_ms,
            ) == (
                load.inflight,
                load.pending_prefill_count,
                load.active_decode_count,
                load.prefill_free_in_ms,
                load.next_slot_ready_in_ms,
                load.predicted_total_backlog_ms,
            ), (step, op, load.id)
    assert any(state.reservation(r) is None for r in rids)  # releases did happen


async def test_the_reserve_walk_matches_the_lua_script(make_coordinator: MakeCoordinator) -> None:
    """reserve.lua's choice among the candidates a node sends and the sim's
    (SharedState.walk) agree, case by case, on the same state: the first within all its
    bounds, the soonest prefill start among those within their counts when none is
    within its free-at bound or when one past it starts sooner than the first within
    all, the least busy at or below the pool's mean, and `stale`."""
    c = await make_coordinator("n1")
    rids_key = c.keys.node_rids("n1")
    state = SharedState()
    for k in range(3):
        s = spec(k, prefill_ms_per_token=0.1, prefill_overhead_ms=5.0, decode_ms_per_token=10.0)
        await c.register_instance(s)
        state.register(s, int(await c.redis.hget(c.keys.column("last_seen_ms"), s.id)))
    never = 4398046511103  # the largest time a record holds: no free-at bound that binds

    async def reserve(rid: str, groups: list[tuple[str, int, int, int, int]]) -> str | None:
        """Both sides on one ranked list (id, prefill_ms, max inflight, max pending,
        max free-at): the instance each took (None: stale), the sim mirroring a take."""
        args: list[object] = [rid, "n1", 100, 10, 0, 0, 600_000, 600_000, "", len(groups), 0, ""]
        for iid, prefill_ms, *bounds in groups:
            args += [iid, pack_candidate(NO_SLOT, prefill_ms, 100, *bounds)]
        now = await redis_now(c)
        at = state.walk(groups, now)
        reply = await c._direct_call("reserve", args, (rids_key,))
        taken = str(reply[1]) if reply[0] == "ok" else None
        assert taken == (None if at is None else groups[at][0]), (rid, reply[0], at)
        if taken is not None:
            created = (await live_reservations(c))[rid]["created_ms"]
            prefill = next(g[1] for g in groups if g[0] == taken)
            state.reserve(rid, "n1", taken, 100, 10, prefill, 100, created)
            ours, theirs = sim_state(state, ["i0", "i1", "i2"], set()), await lua_state(c)
            assert (ours["columns"], ours["earliest_end"]) == (
                theirs["columns"],
                theirs["earliest_end"],
            )
        return taken

    # i0 prefills for 10 s, i1 for 1 s, i2 is idle.
    assert await reserve("load0", [("i0", 10_005, never, never, never)]) == "i0"
    assert await reserve("load1", [("i1", 1_005, never, never, never)]) == "i1"
    # Busy past their free-at bounds: the next within all its bounds.
    assert await reserve("w1", [(f"i{k}", 50, 9, 9, 1) for k in range(3)]) == "i2"
    # None within its free-at bound: the one that starts the prefill soonest.
    assert await reserve("w2", [("i0", 50, 9, 9, 1), ("i1", 50, 9, 9, 1)]) == "i1"
    # One past its free-at bound starts sooner than the next within all its bounds.
    assert await reserve("w2b", [("i1", 50, 9, 9, 1), ("i0", 50, 9, 9, never)]) == "i1"
    # None within its counts: the least busy (i0, 1 live) at or below the mean (5 / 3).
    assert await reserve("w3", [("i1", 50, 0, 0, 0), ("i0", 50, 0, 0, 0)]) == "i0"
    # Above its counts, and above the mean (i1: 3 live, the pool 6 on 3 instances).
    assert await reserve("w4", [("i1", 50, 0, 0, 0)]) is None
    # i2 (1 live) over its counts: i1 (3) and i0 (2) within theirs but busier than
    # i2, so none is taken; the least busy, i2, is at or below the mean (6 on 3).
    passed_over = ("i2", 50, 0, 0, 0)
    assert await reserve("w5", [passed_over, ("i1", 50, 9, 9, 0), ("i0", 50, 9, 9, 0)]) == "i2"
    # i2 (2 live) over its counts: i0, within its own, no busier.
    assert await reserve("w6", [passed_over, ("i0", 50, 9, 9, 0)]) == "i0"
    # i1 queues a minute of prefill (4 live); i2 gets busier (5 live), not slower.
    assert await reserve("load2", [("i1", 60_005, never, never, never)]) == "i1"
    for k in range(3):
        assert await reserve(f"x{k}", [("i2", 50, never, never, never)]) == "i2"
    # i1, passed over, has fewer live reservations than i2 but a longer TTFT, so it
    # does not beat i2 (the less busy instance is not better behind a long prefill).
    assert await reserve("w7", [("i1", 50, 0, 0, 1), ("i2", 50, 9, 9, never)]) == "i2"
    # i0 (3 live, 10 s of prefill), passed over, beats i1 (4 live, a minute), and is
    # the least busy (the pool: 13 on 3 instances).
    assert await reserve("w8", [("i0", 50, 0, 0, 1), ("i1", 50, 9, 9, never)]) == "i0"
