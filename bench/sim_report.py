"""Run the simulator over both Azure traces and print the docs/benchmarks.md section.

    python bench/sim_report.py [TRACE ...] [--limit 10000] [--write-docs]

For each trace: the strategy table at utilization 0.8, a few what-if runs of
least_load, a TTFT CDF plot, and p99 TTFT against utilization. With --write-docs,
only the text between `<!-- sim:start -->` and `<!-- sim:end -->` in
docs/benchmarks.md is replaced and the plots go to docs/img/ (matplotlib, Agg;
`pip install -e '.[bench]'`); without it the section is printed and plots are drawn
only into an --img folder named on the command line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.docs import add_write_docs, write_section
from bench.sim.report import describe, markdown_table, markdown_targets, run_trace
from bench.sim.simulator import STRATEGIES, SimConfig, StrategyResult, compare
from bench.sim.traces import load_trace, scale_to_utilization
from coordinator.settings import Weights

ROOT = Path(__file__).resolve().parent.parent
TRACES = [ROOT.parent / "shared" / "traces" / f"azure_llm_2023_{k}.csv" for k in ("code", "conv")]
UTILIZATIONS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
TABLE_UTILIZATION = 0.8
# The what-if rows name their preset: unnamed weights keep the `seed` preset's.
PROPOSED = "seed,backlog_ms=0.05"  # the seed's weights with the backlog weighed 50x
NO_HINTS = "ttft,engine_running=0,engine_waiting=0"  # the defaults without engine hints
PROPOSED_LABEL = f"least_load, weights {PROPOSED}"


def rel(path: Path | str) -> str:
    """A path as written in commands: relative to the repo root when possible."""
    try:
        return os.path.relpath(Path(path).resolve(), ROOT)
    except ValueError:
        return str(path)


def sim_command(trace: Path, limit: int | None, seed: int, *extra: str) -> str:
    cmd = ["coordinator", "bench", "sim", "--trace", rel(trace)]
    cmd += ["--utilization", f"{TABLE_UTILIZATION:g}"]
    if limit:
        cmd += ["--limit", str(limit)]
    return shlex.join([*cmd, "--seed", str(seed), *extra])


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def short_name(trace: Path) -> str:
    return trace.stem.removeprefix("azure_llm_2023_")


def what_if(trace: Path, limit: int | None, seed: int) -> list[tuple[str, str, StrategyResult]]:
    """least_load under changed inputs: (label, extra CLI flags, result)."""
    base = SimConfig(seed=seed)
    reqs = scale_to_utilization(
        load_trace(trace, limit), base.timing, base.instances, TABLE_UTILIZATION
    )
    proposed = Weights.parse(PROPOSED)
    cases = [
        (
            f"least_load, weights {PROPOSED}",
            ("--weights", PROPOSED),
            "least_load",
            replace(base, weights=proposed),
        ),
        (
            f"least_load, weights {NO_HINTS}",
            ("--weights", NO_HINTS),
            "least_load",
            replace(base, weights=Weights.parse(NO_HINTS)),
        ),
        (
            f"power_of_two, weights {PROPOSED}",
            ("--weights", PROPOSED),
            "power_of_two",
            replace(base, weights=proposed),
        ),
        (
            "least_load, expected output = true length",
            ("--expected-output", "true"),
            "least_load",
            replace(base, expected_output="true"),
        ),
        (
            "least_load, max_slots 0 (unlimited)",
            ("--max-slots", "0"),
            "least_load",
            replace(base, max_slots=0),
        ),
        (
            "least_load_instantaneous, hints every 100 ms",
            ("--hint-interval-ms", "100"),
            "least_load_instantaneous",
            replace(base, hint_interval_ms=100.0),
        ),
    ]
    out = []
    for label, flags, strategy, config in cases:
        log(f"  what-if: {label}")
        (result,) = compare(reqs, [strategy], config)
        out.append((label, shlex.join(["--strategies", strategy, *flags]), result))
    return out


def sweep(
    trace: Path,
    limit: int | None,
    seed: int,
    utilizations: Sequence[float],
    known: dict[float, list[StrategyResult]],
) -> dict[float, list[StrategyResult]]:
    """Every strategy at every utilization (reusing runs already made)."""
    config = SimConfig(seed=seed)
    reqs = load_trace(trace, limit)
    out = {}
    for u in utilizations:
        if u in known:
            out[u] = known[u]
            continue
        log(f"  utilization {u:g}")
        scaled = scale_to_utilization(reqs, config.timing, config.instances, u)
        (tuned,) = compare(scaled, ["least_load"], replace(config, weights=Weights.parse(PROPOSED)))
        out[u] = [*compare(scaled, STRATEGIES, config), replace(tuned, strategy=PROPOSED_LABEL)]
    return out


def burstiness(trace: Path, limit: int | None) -> float:
    """The busiest minute's arrivals over the mean per minute (as recorded)."""
    reqs = load_trace(trace, limit)
    counts: dict[int, int] = {}
    for r in reqs:
        minute = int(r.arrival_ms // 60_000)
        counts[minute] = counts.get(minute, 0) + 1
    return max(counts.values()) / (len(reqs) / len(counts))


def _by(results: Sequence[StrategyResult]) -> dict[str, StrategyResult]:
    return {r.strategy: r for r in results}


def findings(
    traces: list[tuple[str, float, list[StrategyResult], list[tuple[str, str, StrategyResult]]]],
) -> str:
    """The explanation of the numbers above, with the numbers filled in."""
    lines = ["### What the numbers say", ""]
    for name, bursts, results, variants in traces:
        r = _by(results)
        v = {label: res for label, _, res in variants}
        ll, oracle = r["least_load"].ttft_p99_ms, r["oracle"].ttft_p99_ms
        local, inst = (
            r["local_least_inflight"].ttft_p99_ms,
            r["least_load_instantaneous"].ttft_p99_ms,
        )
        tuned = v[f"least_load, weights {PROPOSED}"].ttft_p99_ms
        no_hints = v[f"least_load, weights {NO_HINTS}"].ttft_p99_ms
        true_out = v["least_load, expected output = true length"].ttft_p99_ms
        met = sum(
            x <= limit
            for x, limit in ((tuned / oracle, 1.25), (tuned / local, 0.7), (tuned / inst, 0.8))
        )
        lines.append(
            f"- **{name}** (busiest minute {bursts:.1f}× the mean rate): least_load p99 is "
            f"{ll / oracle:.2f}× the oracle, {ll / local:.2f}× local_least_inflight, "
            f"{ll / inst:.2f}× least_load_instantaneous with the default weights; with "
            f"`{PROPOSED}` it is {tuned / oracle:.2f}×, {tuned / local:.2f}× and "
            f"{tuned / inst:.2f}× ({met} of 3 targets met). Without the hints "
            f"(`{NO_HINTS}`): {no_hints / oracle:.2f}× the oracle. Reserving the true "
            f"output length instead of the running average: {true_out / oracle:.2f}×. "
            f"The oracle itself is {oracle / local:.2f}× local_least_inflight."
        )
    lines += [
        "",
        "Why. *Bursts*: at a mean utilization of 0.8 a trace whose busiest minute runs at "
        "several times the mean rate saturates the whole fleet for minutes; every engine "
        "then holds seconds of queue, and any dispatcher that keeps every engine busy is "
        "about as good as any other, the oracle included. Ratios near 1 there say that "
        "no placement helps, not that the strategies are equal in general; the 0.7× and "
        "0.8× targets are out of reach for every strategy on such a trace. *The backlog "
        "weight*: TTFT is the prefill queue in front of a request (prefills are "
        "serialized and take priority), and the predicted prefill cursor "
        "(`prefill_free_in_ms`) tracks it almost exactly, since the instances register "
        "their engines' timing. The seed's `backlog_ms` weight is 0.001 per ms: 300 ms "
        "of backlog scores 0.3, less than one request in any count term (inflight 1.0, "
        "engine_running 1.0, pending_prefill 1.0, active_decode 0.5), so by itself it "
        "ranks by request counts. The default weights (preset `ttft`, which these "
        "least_load rows run) replace it by the request-aware `ttft_ms` (the backlog "
        "plus the request's own uncached prefill) at 0.2 per ms: 5 ms of predicted TTFT "
        "count as much as one request, so a pending 8k-token prompt outweighs any queue "
        "of short ones. "
        "*Hints*: a raw engine_running repeats what the shared inflight counter already "
        "knows, up to one scrape interval late, so it adds noise: on the conversation "
        "trace least_load_instantaneous (raw hints) is worse than per-node counting, even "
        "with hints scraped every 100 ms. The row without hints shows what they add to "
        "least_load here (the simulated engines serve only the fleet, so every hint "
        "repeats reservations). *The expected output* does "
        "not move the ranking: it enters the score only through `next_slot_ready_in_ms`, "
        "which is non-zero only while an instance holds `max_slots` reservations.",
        "",
        "The engines here match their registration exactly; learned timing on engines "
        "that do not is measured in the `prediction-*` sections below.",
    ]
    return "\n".join(lines)


# A line plot: one (label, xs, ys, style) per line.
Lines = list[tuple[str, list[float], list[float], str]]


def _plot(lines: Lines, log_axis: str, labels: tuple[str, str], title: str, path: Path) -> None:
    """One line plot, with a log `log_axis` ("x" or "y"), saved as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys, style in lines:
        # Points are measured values on the utilization plot; a CDF is a dense line.
        marker = "o" if log_axis == "y" else None
        ax.plot(xs, ys, style, label=label, linewidth=1.4, marker=marker, markersize=3)
    (ax.set_xscale if log_axis == "x" else ax.set_yscale)("log")
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(results: Sequence[StrategyResult], title: str, path: Path) -> None:
    """TTFT CDF of every strategy, on a log time axis."""
    lines: Lines = []
    for r in results:
        xs = sorted(r.ttft_ms)
        lines.append((r.strategy, xs, [(i + 1) / len(xs) for i in range(len(xs))], "-"))
    labels = ("TTFT (ms, log scale)", "fraction of requests")
    _plot(lines, "x", labels, title, path)


def plot_p99(curves: dict[float, list[StrategyResult]], title: str, path: Path) -> None:
    """TTFT p99 of every strategy against offered utilization."""
    us = sorted(curves)
    lines: Lines = []
    for r0 in curves[us[0]]:
        name = r0.strategy
        ys = [next(r.ttft_p99_ms for r in curves[u] if r.strategy == name) for u in us]
        lines.append((name, us, ys, "--" if name == PROPOSED_LABEL else "-"))
    labels = (
        "offered utilization (fraction of nominal fleet capacity)",
        "TTFT p99 (ms, log scale)",
    )
    _plot(lines, "y", labels, title, path)


def what_if_table(rows: list[tuple[str, str, StrategyResult]], base: list[StrategyResult]) -> str:
    oracle = next(r for r in base if r.strategy == "oracle")
    default = next(r for r in base if r.strategy == "least_load")
    lines = [
        "| variant | TTFT p50 ms | TTFT p99 ms | p99 / oracle | e2e p99 ms | flags |",
        "|---|---:|---:|---:|---:|---|",
        f"| least_load, default weights | {default.ttft_p50_ms:,.0f} | {default.ttft_p99_ms:,.0f} "
        f"| {default.ttft_p99_ms / oracle.ttft_p99_ms:.2f} | {default.e2e_p99_ms:,.0f} | |",
    ]
    for label, flags, r in rows:
        lines.append(
            f"| {label} | {r.ttft_p50_ms:,.0f} | {r.ttft_p99_ms:,.0f} "
            f"| {r.ttft_p99_ms / oracle.ttft_p99_ms:.2f} | {r.e2e_p99_ms:,.0f} | `{flags}` |"
        )
    return "\n".join(lines)


def section(args: argparse.Namespace, command: str, parts: list[str], seconds: float) -> str:
    limit_note = (
        f"at most the first {args.limit} requests of each trace (`--limit {args.limit}`)"
        if args.limit
        else "every request of each trace"
    )
    head = f"""## Scheduling quality: discrete-event simulation

Generated by `{command}` in {seconds:.0f} s; it uses {limit_note}. Each table
also names the `coordinator bench sim` command that reproduces it alone.

What runs (bench/sim/): the engines are `local_fleet.engine_model.EngineModel`,
the model the mock engine runs, with its default timing (H100-like, 7-8B: prefill
0.08 ms/token + 10 ms, decode step 12 ms + 0.25 ms per running sequence, batch
≤ 32). The coordinator side is the real code: `coordinator.strategies` scoring rows
from `coordinator.pressure.instance_load`, over an in-memory pool whose semantics
tests/benchmarks/test_sim.py checks step by step against the Lua scripts on a real server.
Arrivals are spread over 3 proxy nodes round-robin; each node has its own
round-robin counter, random generator and running average of output lengths (the
expected output it reserves) and its own view of the pool, kept as a real node
keeps it: read again once 500 ms old (`snapshot_max_age_ms`), hints every 2000 ms
(`live_refresh_ms`), in between only its own reserves, marks and releases, with the
reserve script's check of each candidate against what the node saw. Engine hints
(num_running/num_waiting) are scraped every 1000 ms. Instances register the engine's timing with
`decode_ms_per_token` at a half-full batch and `max_slots` = the engine's batch.

Definitions. *Utilization*: arrival rate × mean service / instances, where a
request's service is its prefill plus (output − 1) × step(16)/16, its share of decode
steps at a half-full batch; inter-arrival times are scaled to hit it (sizes are
untouched). *Queue wait*: arrival to prefill start. *Imbalance*: max / mean over
instances of the service assigned. Ratios in parentheses are to the oracle, one
central dispatcher that knows every engine's exact state and sends each request
where its TTFT is smallest. Targets are measured, not asserted.
"""
    return head + "\n" + "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, default=TRACES, help="Azure CSV traces")
    parser.add_argument("--limit", type=int, default=10000, help="first N requests (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--utilizations",
        default=",".join(f"{u:g}" for u in UTILIZATIONS),
        help="comma list for the p99 plot",
    )
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument(
        "--img", type=Path, default=None, help="plot folder (default with --write-docs: docs/img)"
    )
    add_write_docs(parser, "--doc (and the plots into docs/img)")
    args = parser.parse_args(argv)
    if args.img is None and args.write_docs:
        args.img = ROOT / "docs" / "img"
    limit = args.limit or None
    utilizations = [float(u) for u in args.utilizations.split(",") if u.strip()]
    if args.img is not None:
        import matplotlib

        matplotlib.use("Agg")
        args.img.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    parts: list[str] = []
    summary = []
    traces = [] if args.traces == TRACES else [rel(t) for t in args.traces]
    command = shlex.join(
        ["python", "bench/sim_report.py", "--write-docs", *traces]
        + (["--limit", str(args.limit)] if args.limit != 10000 else [])
        + (["--seed", str(args.seed)] if args.seed else [])
    )
    for trace in args.traces:
        name = short_name(trace)
        log(f"{name}: utilization {TABLE_UTILIZATION:g}, every strategy")
        run = run_trace(
            trace, utilization=TABLE_UTILIZATION, limit=limit, config=SimConfig(seed=args.seed)
        )
        cdf = Path("img") / f"sim_ttft_cdf_{name}.png"
        p99 = Path("img") / f"sim_p99_vs_util_{name}.png"
        if args.img is not None:
            cdf, p99 = args.img / cdf.name, args.img / p99.name
            plot_cdf(run.results, f"TTFT CDF, {name} trace, utilization 0.8\n{command}", cdf)
        variants = what_if(trace, limit, args.seed)
        tuned = next(
            r for label, _, r in variants if label.startswith("least_load, weights " + PROPOSED)
        )
        known = {TABLE_UTILIZATION: [*run.results, replace(tuned, strategy=PROPOSED_LABEL)]}
        curves = sweep(trace, limit, args.seed, utilizations, known)
        if args.img is not None:
            plot_p99(curves, f"TTFT p99 vs utilization, {name} trace\n{command}", p99)
        summary.append((name, burstiness(trace, limit), run.results, variants))
        parts.append(
            f"### `{trace.name}` at utilization {TABLE_UTILIZATION:g}\n\n"
            f"{describe(run)}.\n\n{markdown_table(run.results)}\n\n"
            f"{markdown_targets(run.results)}\n\n"
            f"Regenerate this table: `{sim_command(trace, limit, args.seed)}`\n\n"
            f"What-if runs of the same trace (least_load unless named; append the flags to "
            f"the command above):\n\n{what_if_table(variants, run.results)}\n\n"
            f"![TTFT CDF, {name}](img/{cdf.name})\n\n"
            f"![TTFT p99 vs utilization, {name}](img/{p99.name})\n\n"
            f"Both plots: `{command}` (utilizations {', '.join(f'{u:g}' for u in utilizations)}; "
            f"the dashed line is least_load with the weights `{PROPOSED}`)."
        )
    parts.append(findings(summary))
    seconds = time.monotonic() - started
    text = section(args, command, parts, seconds)
    print(text)
    if args.write_docs:
        write_section("sim", text, args.doc)
        log(f"wrote {rel(args.doc)} and {len(args.traces) * 2} plots in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
