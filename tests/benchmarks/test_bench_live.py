"""`coordinator bench live`: request building, summaries, and one small real run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from bench.live import (
    AUTO_MAX_SPEED,
    AUTO_MIN_SPEED,
    Comparison,
    LiveConfig,
    Outcome,
    auto_speed,
    build_request,
    keep_if_piled,
    load_slice,
    prompt_text,
    summarize,
    trace_prompt,
)
from bench.sim.simulator import StrategyResult
from bench.sim.traces import TraceRequest
from coordinator.settings import Settings
from coordinator.tokens import estimate_tokens, max_output_tokens_of, prompt_tokens_of
from coordinator_cli.main import main


def _write_trace(path: Path, n: int) -> Path:
    lines = [
        json.dumps(
            {
                "timestamp": 40.0 * i + (15.0 if i % 5 == 0 else 0.0),
                "input_length": 50 + 37 * (i % 11),
                "output_length": 3 + (i % 7),
            }
        )
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------
# Units: no cluster.


@pytest.mark.parametrize("tokens", [0, 1, 7, 1469, 4808])
def test_request_prompt_is_four_chars_per_token(tokens: int) -> None:
    req = TraceRequest(index=3, arrival_ms=0.0, prompt_tokens=tokens, output_tokens=13)
    raw, headers = build_request(req)
    body = json.loads(raw)
    content = body["messages"][0]["content"]
    assert len(content) == 4 * tokens
    assert len(raw) >= 4 * tokens  # ASCII filler: no escaping inflates or shrinks it
    assert prompt_tokens_of(body) == tokens == estimate_tokens(prompt_text(tokens))
    assert max_output_tokens_of(body) == 13
    assert body["stream"] is True
    assert headers["X-Mock-Output-Tokens"] == "13"
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Request-Id"].startswith("live-3-")


def test_prompts_without_prefix_blocks_share_no_prefix_block() -> None:
    # Azure rows have no hash_ids: one filler for every prompt would be one shared
    # prefix to the nodes' index and the engines' caches.
    chars = Settings().prefix_block_chars
    tokens = 3 * chars // 4
    first_blocks = {trace_prompt(TraceRequest(i, 0.0, tokens, 8))[:chars] for i in range(50)}
    assert len(first_blocks) == 50


def test_load_slice_rebases_and_scales_like_the_sim(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", 20)
    rows = load_slice(trace, offset=5, limit=10, utilization=None, instances=2)
    assert [r.index for r in rows] == list(range(10))
    assert rows[0].arrival_ms == 0.0
    assert rows[1].arrival_ms == pytest.approx(40.0 - 15.0)  # request 5 carried +15 ms
    assert rows[0].prompt_tokens == 50 + 37 * 5
    scaled = load_slice(trace, offset=5, limit=10, utilization=0.5, instances=2)
    slower = load_slice(trace, offset=5, limit=10, utilization=0.25, instances=2)
    assert scaled[-1].arrival_ms * 2 == pytest.approx(slower[-1].arrival_ms)
    assert [r.prompt_tokens for r in scaled] == [r.prompt_tokens for r in rows]


def test_auto_speed_stays_in_bounds() -> None:
    light = [TraceRequest(i, i * 10_000.0, 100, 1) for i in range(10)]
    heavy = [TraceRequest(i, i * 1.0, 100, 1000) for i in range(10)]
    assert auto_speed(light) == AUTO_MAX_SPEED
    assert auto_speed(heavy) == AUTO_MIN_SPEED


def test_live_config_puts_node_knobs_on_engine_time() -> None:
    config = LiveConfig(speed=4.0)
    env = config.node_env("seed")
    assert float(env["COORD_SCRAPE_INTERVAL_S"]) == pytest.approx(0.25)
    assert "backlog_ms=0.004" in env["COORD_WEIGHTS"]
    # The default preset's ms-valued weight is put on engine time the same way.
    assert "ttft_ms=0.8" in config.node_env()["COORD_WEIGHTS"]
    sim = config.sim_config()
    assert sim.hint_interval_ms == pytest.approx(1000.0)
    assert sim.expected_output == "true"
    # How old a node's view may get is on engine time too, and the sim's nodes keep
    # theirs as long (at speed 4 a 1 s real view would be 4 s of engine time old).
    s = Settings()
    assert env["COORD_SNAPSHOT_MAX_AGE_MS"] == str(s.snapshot_max_age_ms // 4)
    assert env["COORD_LIVE_REFRESH_MS"] == str(s.live_refresh_ms // 4)
    assert env["COORD_CARRY_MS"] == str(s.carry_ms // 4)
    assert env["COORD_TIMING_FLUSH_MS"] == str(s.timing_flush_ms // 4)
    # The sim's nodes: the real nodes' (rounded) ms times the speed.
    assert (sim.snapshot_max_age_ms, sim.live_refresh_ms, sim.timing_flush_ms) == tuple(
        int(env[name]) * 4
        for name in ("COORD_SNAPSHOT_MAX_AGE_MS", "COORD_LIVE_REFRESH_MS", "COORD_TIMING_FLUSH_MS")
    )
    # Slower than real time, liveness still comes every instance_ttl_ms / 4 (real).
    slow = LiveConfig(speed=0.1).sim_config()
    assert slow.live_refresh_ms == round(s.instance_ttl_ms / 4 * 0.1)
    assert slow.snapshot_max_age_ms == s.snapshot_max_age_ms
    with pytest.raises(ValueError):
        _ = LiveConfig().rate  # auto is unresolved until run_live sees the slice


def test_summarize_counts_and_engine_time() -> None:
    reqs = [TraceRequest(i, 0.0, 10, 4) for i in range(3)]
    outcomes = [
        Outcome(
            0, 0, due_s=1.0, sent_s=1.001, first_s=1.010, end_s=1.050, status=200, instance="e1"
        ),
        Outcome(
            1, 1, due_s=1.0, sent_s=1.002, first_s=1.020, end_s=1.060, status=200, instance="e0"
        ),
        Outcome(2, 0, due_s=1.0, sent_s=1.003, status=502, instance="e0", error="HTTP 502"),
    ]
    result = summarize("least_load", reqs, outcomes, speed=10.0)
    assert (result.completed, result.failed) == (2, 1)
    assert result.assigned == {"e0": 2, "e1": 1}
    assert result.ttft_p50_ms == pytest.approx(150.0)  # 15 ms real from due, x10
    assert result.e2e_p99_ms == pytest.approx(599.0)  # 500 and 600, interpolated
    assert result.errors == ("HTTP 502",)
    assert result.output_tokens_per_s == pytest.approx(8 / 0.06)


def test_agreement_check_uses_the_twenty_percent_band() -> None:
    def sim(p50: float) -> StrategyResult:
        return StrategyResult("least_load", 1, 1, p50, p50, p50, p50, p50, 0.0, 1.0, (1,), ())

    reqs = [TraceRequest(0, 0.0, 10, 4)]
    out = [Outcome(0, 0, 0.0, 0.0, 0.011, 0.02, 200, "e0")]
    live = summarize("least_load", reqs, out, speed=10.0)  # TTFT 110 ms
    assert Comparison(live, sim(100.0)).agree
    assert not Comparison(live, sim(80.0)).agree
    assert "FAIL" in Comparison(live, sim(80.0)).check_line()
    assert math.isnan(Comparison(live, sim(0.0)).ratio)
    assert Comparison(live, sim(100.0), speed=10.0).client_note == ""
    lagging = [Outcome(0, 0, 0.0, 0.005, 0.011, 0.02, 200, "e0")]  # sent 5 ms late
    late = summarize("least_load", reqs, lagging, speed=10.0)
    note = Comparison(late, sim(100.0), speed=10.0).check_line()
    assert "PASS" in note and "client lagged 50 ms" in note


# ---------------------------------------------------------------------------
# A small real run: Redis, 2 nodes, 2 mock engines, through the CLI.


@pytest.mark.slow
@pytest.mark.real
def test_live_run_completes_every_request(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "small.jsonl", 30)
    code = main(
        [
            "bench",
            "live",
            "--trace",
            str(trace),
            "--limit",
            "30",
            "--instances",
            "2",
            "--nodes",
            "2",
            "--speed",
            "20",
            "--strategies",
            "least_load",
            "--redis-url",
            redis_url,
            "--request-timeout-s",
            "20",
            "--json",
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report: dict[str, Any] = json.loads(captured.out)
    assert report["requests"] == 30
    assert report["config"]["speed"] == 20.0
    for name in ("offered_utilization", "span_ms", "output_tokens", "runtime_s"):
        assert name in report
    (result,) = report["results"]
    assert result["strategy"] == "least_load"
    assert (result["completed"], result["failed"]) == (30, 0), result["errors"]
    assert sum(result["assigned"].values()) == 30
    assert set(result["assigned"]) <= {"engine-0", "engine-1"}
    for name in (
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "e2e_p50_ms",
        "e2e_p99_ms",
        "lateness_p99_ms",
        "output_tokens_per_s",
        "ttft_p50_ratio",
        "agree",
    ):
        assert name in result
    assert result["sim"]["completed"] == 30
    assert sum(result["sim"]["assigned"]) == 30
    # The run's pool was deleted from the shared server afterwards.
    client = Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match="lc:{live-*")) == []
    finally:
        client.close()


def test_summarize_reports_wait_and_prediction_accuracy() -> None:
    """Wait = TTFT - own prefill on the engine's true speed; errors against the client's TTFT."""
    from bench.live import PREDICTION_WARMUP
    from local_fleet.engine_model import EngineTiming

    reqs = [TraceRequest(i, 0.0, 1000, 4) for i in range(PREDICTION_WARMUP + 2)]
    outcomes = []
    for i in range(len(reqs)):
        out = Outcome(i, 0, due_s=1.0, sent_s=1.0, first_s=1.2, end_s=1.5, status=200)
        out.instance = "slow" if i % 2 else "fast"
        out.predicted_ms = 150.0 if i < len(reqs) - 1 else math.nan
        outcomes.append(out)
    result = summarize("least_load", reqs, outcomes, 1.0, {"slow": 0.5, "fast": 2.0})
    prefill = EngineTiming().prefill_ms(1000)
    assert result.wait_p99_ms == pytest.approx(200.0 - prefill / 2.0)
    assert result.predicted_share == pytest.approx(0.5)  # 1 of the 2 after the warm-up
    assert result.prediction_error_p50 == pytest.approx(0.25)  # |200 - 150| / 200


class _Logged:
    """A stand-in cluster whose logs are one file."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def keep_logs(self, into: Path) -> None:
        (into / "node-0.log").write_text(self.logs.read_text())


def test_a_piled_up_run_keeps_its_logs_and_views(tmp_path: Path) -> None:
    """Over PILED times the mean on one engine: the logs, every node's view and the
    requests per instance are kept; a balanced run keeps nothing."""
    log = tmp_path / "log"
    log.write_text("coordination degraded: test\n")
    views = [{"instances": [{"id": "engine-0"}]}, {"instances": []}]
    even = [Outcome(i, 0, 0.0, instance=f"engine-{i % 4}") for i in range(40)]
    assert keep_if_piled(_Logged(log), even, views, 4) == ""
    piled = [Outcome(i, 0, 0.0, instance="engine-0" if i < 21 else "engine-1") for i in range(40)]
    kept = Path(keep_if_piled(_Logged(log), piled, views, 4))
    assert (kept / "node-0.log").read_text() == "coordination degraded: test\n"
    assert json.loads((kept / "node-1-instance_loads.json").read_text()) == views[1]
    assert json.loads((kept / "requests_per_instance.json").read_text()) == {
        "engine-0": 21,
        "engine-1": 19,
    }
