"""Unit tests of coordinator/strategies.py: pure functions over InstanceLoad rows, no Redis."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from coordinator import InstanceLoad, InstanceSpec, InvalidArgumentError, Weights
from coordinator.models import RequestShape
from coordinator.strategies import (
    LazyLoads,
    Ranking,
    RoundRobin,
    eligible,
    least_load,
    power_of_two,
    rank,
    ranked_ids,
    round_robin,
    score_rows,
)


def row(iid: str, **fields: Any) -> InstanceLoad:
    """An alive, idle, fully-known candidate; keyword arguments override any field."""
    weight = fields.pop("weight", 1.0)
    spec = InstanceSpec(id=iid, url="http://127.0.0.1:9000", weight=weight)
    values: dict[str, Any] = {
        "id": iid,
        "url": spec.url,
        "role": "mixed",
        "weight": weight,
        "epoch": 1,
        "alive": True,
        "last_seen_age_ms": 0,
        "max_slots": 0,
        "inflight": 0,
        "pending_prefill_count": 0,
        "active_decode_count": 0,
        "next_slot_ready_in_ms": 0,
        "prefill_free_in_ms": 0,
        "predicted_total_backlog_ms": 0,
        "engine_running": 0.0,
        "engine_waiting": 0.0,
        "queue_depth": 0.0,
        "hint_ages_ms": {},
        "spec": spec,
    }
    values.update(fields)
    return InstanceLoad(**values)


NO_HINTS: dict[str, Any] = {"engine_running": None, "engine_waiting": None, "queue_depth": None}
NO_PREDICTED: dict[str, Any] = {
    "predicted_total_backlog_ms": None,
    "prefill_free_in_ms": None,
    "next_slot_ready_in_ms": None,
}


def choose(rows: list[InstanceLoad], weights: Weights | None = None) -> str:
    """The least_load choice with a fresh rotation counter."""
    ranking = least_load(rows, weights or Weights(), RoundRobin())
    assert ranking.choice is not None
    return ranking.choice.id


def choices(rows: list[InstanceLoad], n: int, weights: Weights | None = None) -> list[str]:
    """n successive least_load choices sharing one rotation counter."""
    rr = RoundRobin()
    out = []
    for _ in range(n):
        choice = least_load(rows, weights or Weights(), rr).choice
        assert choice is not None
        out.append(choice.id)
    return out


# ---------------------------------------------------------------- seed behaviours


def test_lower_inflight_wins() -> None:
    assert choose([row("a", inflight=3), row("b", inflight=1), row("c", inflight=2)]) == "b"


def test_equal_inflight_higher_pending_prefill_loses() -> None:
    rows = [
        row("a", inflight=2, pending_prefill_count=2),
        row("b", inflight=2, pending_prefill_count=0, active_decode_count=2),
    ]
    assert choose(rows) == "b"
    assert choose(list(reversed(rows))) == "b"


def test_idle_queues_higher_backlog_loses() -> None:
    rows = [
        row("a", predicted_total_backlog_ms=900, prefill_free_in_ms=900),
        row("b", predicted_total_backlog_ms=100, prefill_free_in_ms=100),
    ]
    assert choose(rows) == "b"
    scores = least_load(rows, Weights(), RoundRobin()).scores
    assert scores["a"].weighted_components["backlog_ms"] == pytest.approx(0.9)
    assert scores["b"].total == pytest.approx(0.1)


def test_missing_predicted_falls_back_to_hints() -> None:
    # b looks better on the predicted layer, but a's is unknown, so the layer is dropped
    # for everyone and the hints (where a is idle) decide.
    rows = [
        row("a", engine_running=0.0, **NO_PREDICTED),
        row("b", engine_running=4.0, pending_prefill_count=0, predicted_total_backlog_ms=0),
    ]
    ranking = least_load(rows, Weights(), RoundRobin())
    assert ranking.choice is not None and ranking.choice.id == "a"
    for score in ranking.scores.values():
        assert score.sources["predicted"] == "missing"
        assert score.sources["instantaneous"] == "hints"
        assert score.sources["lifecycle"] == "reservations"
        assert not set(score.weighted_components) & {"pending_prefill", "backlog_ms"}
    assert ranking.scores["a"].components["backlog_ms"] is None
    assert ranking.scores["b"].total == pytest.approx(4.0)


def test_missing_hints_and_predicted_fall_back_to_inflight_only() -> None:
    rows = [
        row("a", inflight=2, engine_running=0.0, **NO_PREDICTED),
        row("b", inflight=1, **NO_HINTS, **NO_PREDICTED),
    ]
    ranking = least_load(rows, Weights(), RoundRobin())
    assert ranking.choice is not None and ranking.choice.id == "b"
    for score in ranking.scores.values():
        assert set(score.weighted_components) == {"inflight"}
        assert score.sources == {
            "lifecycle": "reservations",
            "instantaneous": "missing",
            "predicted": "missing",
        }
    assert ranking.scores["a"].total == 2.0


def test_missing_hints_keep_the_predicted_layer() -> None:
    rows = [
        row("a", inflight=1, pending_prefill_count=1, **NO_HINTS),
        row("b", inflight=1, active_decode_count=1, **NO_HINTS),
    ]
    ranking = least_load(rows, Weights(), RoundRobin())
    assert ranking.choice is not None and ranking.choice.id == "b"
    assert ranking.scores["b"].sources["instantaneous"] == "missing"
    assert ranking.scores["b"].sources["predicted"] == "reservations"


def test_a_stale_hint_is_missing_not_zero() -> None:
    # If a's missing engine_running counted as 0, a would always win; it is dropped
    # for every candidate instead, so a and b tie and rotate.
    rows = [row("a", inflight=1, engine_running=None), row("b", inflight=1, engine_running=3.0)]
    assert sorted(set(choices(rows, 4))) == ["a", "b"]
    scores = least_load(rows, Weights(), RoundRobin()).scores
    assert "engine_running" not in scores["b"].weighted_components
    assert "engine_waiting" in scores["b"].weighted_components


def test_all_unknown_totals_rotate_round_robin() -> None:
    rows = [row(i, inflight=None, **NO_HINTS, **NO_PREDICTED) for i in ("c", "a", "b")]
    assert choices(rows, 6) == ["a", "b", "c", "a", "b", "c"]
    scores = least_load(rows, Weights(), RoundRobin()).scores
    assert all(s.total is None for s in scores.values())
    assert all(set(s.sources.values()) == {"missing"} for s in scores.values())


def test_a_tie_that_changes_from_call_to_call_starves_no_instance() -> None:
    """A node ranking on its own counts (degraded mode): every ~150 ms a request that
    takes ~280 ms, so the instances its last requests hold leave a different tie each
    time. A rotation by a counter modulo the tie's size gave one of 4 instances 5-13%
    of the requests live; each turn starting after the previous one's gives each
    exactly its share (`turns`, which degraded mode ranks with)."""
    ids = ["e0", "e1", "e2", "e3"]
    rr = RoundRobin(turns=True)
    running: list[tuple[int, str]] = []  # (end ms, instance)
    counts = dict.fromkeys(ids, 0)
    for i in range(400):
        now = 150 * i
        running = [(end, iid) for end, iid in running if end > now]
        held = [iid for _, iid in running]
        rows = [row(iid, inflight=held.count(iid), **NO_HINTS) for iid in ids]
        choice = least_load(rows, Weights(), rr).choice
        assert choice is not None and choice.inflight == min(r.inflight for r in rows)
        counts[choice.id] += 1
        running.append((now + 280 + 10 * (i % 4), choice.id))
    assert counts == dict.fromkeys(ids, 100)


def test_round_robin_takes_turns_as_candidates_come_and_go() -> None:
    rr = RoundRobin(turns=True)
    every = [row(i) for i in ("a", "b", "c", "d")]

    def pick(rows: list[InstanceLoad]) -> str:
        choice = round_robin(rows, Weights(), rr).choice
        assert choice is not None
        return choice.id

    assert [pick(every) for _ in range(2)] == ["a", "b"]
    assert pick([r for r in every if r.id != "c"]) == "d"  # c left: the turn goes on
    assert [pick(every) for _ in range(3)] == ["a", "b", "c"]


def test_ties_at_the_minimum_rotate_and_never_pick_a_worse_one() -> None:
    rows = [row("a", inflight=1), row("b", inflight=5), row("c", inflight=1), row("d", inflight=1)]
    picked = choices(rows, 9)
    assert picked == ["a", "c", "d"] * 3
    ranking = least_load(rows, Weights(), RoundRobin())
    assert ranking.ranked[-1].id == "b"


def test_unknown_total_is_never_chosen_while_one_is_known() -> None:
    rows = [
        row("a", inflight=None, **NO_HINTS, **NO_PREDICTED),
        row("b", inflight=1000, pending_prefill_count=1000, predicted_total_backlog_ms=10**7),
        row("c", inflight=None, **NO_HINTS, **NO_PREDICTED),
    ]
    rr = RoundRobin()
    for _ in range(5):
        ranking = least_load(rows, Weights(), rr)
        assert ranking.ranked[0].id == "b"
        assert {r.id for r in ranking.ranked[1:]} == {"a", "c"}
    # The known row's score still uses every layer it has (unknown rows don't drop them).
    assert ranking.scores["b"].sources["predicted"] == "reservations"


def test_weights_change_the_outcome() -> None:
    rows = [
        row("a", inflight=1),
        row("b", inflight=0, predicted_total_backlog_ms=5000, next_slot_ready_in_ms=5000),
    ]
    assert choose(rows) == "a"  # default: 5000 ms * 0.001 = 5 > 1
    assert choose(rows, Weights(backlog_ms=0)) == "b"
    assert choose(rows, Weights(backlog_ms=0.0001)) == "b"  # 0.5 < 1


def test_engine_waiting_weight_is_a_quarter() -> None:
    rows = [row("a", engine_waiting=3.0), row("b", engine_running=1.0)]
    assert choose(rows) == "a"  # 0.75 < 1.0
    assert choose(rows, Weights(engine_waiting=1.0)) == "b"


# ---------------------------------------------------------------- weights validation


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, math.inf, -math.inf, True, "1", None])
def test_weights_reject_bad_values(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        Weights(inflight=bad)
    with pytest.raises(InvalidArgumentError):
        Weights(backlog_ms=bad)


@pytest.mark.parametrize(
    "text",
    [
        "bogus=1",
        "inflight",
        "inflight:1",
        "inflight=abc",
        "inflight=",
        "inflight=-1",
        "inflight=nan",
        "inflight=inf",
        "backlog_ms=1,engine=2",
    ],
)
def test_weights_parse_rejects(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        Weights.parse(text)


def test_weights_parse_accepts() -> None:
    assert Weights.parse("") == Weights()
    parsed = Weights.parse(" inflight = 2 , backlog_ms=0,")
    assert parsed == Weights(inflight=2.0, backlog_ms=0.0)
    assert parsed.as_dict()["engine_waiting"] == 0.25


# ---------------------------------------------------------------- score objects


def test_score_objects_explain_the_total() -> None:
    weights = Weights(active_decode=0.75)
    rows = [
        row(
            "a",
            inflight=3,
            pending_prefill_count=1,
            active_decode_count=2,
            predicted_total_backlog_ms=250,
            engine_running=2.0,
            engine_waiting=1.0,
            queue_depth=4.0,
        ),
        row("b", inflight=1, weight=2.0),
    ]
    scores = score_rows(rows, weights)
    a = scores["a"]
    assert a.instance_id == "a"
    assert a.weights == weights.as_dict()
    assert a.components == {
        "inflight": 3,
        "engine_running": 2.0,
        "engine_waiting": 1.0,
        "queue_depth": 4.0,
        "pending_prefill": 1,
        "active_decode": 2,
        "backlog_ms": 250,
    }
    for name, value in a.weighted_components.items():
        raw = a.components[name]
        assert raw is not None
        assert value == pytest.approx(weights.as_dict()[name] * raw)
    assert a.total == pytest.approx(3 + 2 + 0.25 + 1 + 1 + 1.5 + 0.25)
    assert a.sources == {
        "lifecycle": "reservations",
        "instantaneous": "hints",
        "predicted": "reservations",
    }
    for score in scores.values():
        weight = next(r.weight for r in rows if r.id == score.instance_id)
        assert score.total == pytest.approx(sum(score.weighted_components.values()) / weight)
    assert set(a.as_dict()) == {
        "instance_id",
        "total",
        "components",
        "weighted_components",
        "sources",
        "weights",
    }


def test_instance_weight_divides_the_total() -> None:
    rows = [row("a", inflight=2), row("b", inflight=3, weight=2.0)]
    ranking = least_load(rows, Weights(), RoundRobin())
    assert ranking.choice is not None and ranking.choice.id == "b"
    assert ranking.scores["b"].total == pytest.approx(1.5)
    assert ranking.scores["b"].weighted_components["inflight"] == 3.0
    assert ranking.scores["a"].total == pytest.approx(2.0)


# ---------------------------------------------------------------- other strategies


def test_round_robin_cycles_in_id_order_whatever_the_load() -> None:
    rows = [row("c", inflight=0), row("a", inflight=99), row("b", inflight=5)]
    rr = RoundRobin()
    seen = []
    for _ in range(7):
        ranking = round_robin(rows, Weights(), rr)
        assert ranking.strategy == "round_robin"
        assert sorted(r.id for r in ranking.ranked) == ["a", "b", "c"]
        assert set(ranking.scores) == {"a", "b", "c"}
        assert ranking.choice is not None
        seen.append(ranking.choice.id)
    assert seen == ["a", "b", "c", "a", "b", "c", "a"]
    # Same input order or not, a fresh counter gives the same sequence.
    rr2 = RoundRobin()
    again = []
    for _ in range(7):
        choice = round_robin(list(reversed(rows)), Weights(), rr2).choice
        assert choice is not None
        again.append(choice.id)
    assert again == seen


def test_power_of_two_picks_the_lower_scored_sample() -> None:
    rows = [row(f"i{k}", inflight=k) for k in range(8)]
    rng = random.Random(1234)
    rr = RoundRobin()
    sampled_pairs = set()
    for _ in range(200):
        ranking = power_of_two(rows, Weights(), rr, rng)
        assert ranking.strategy == "power_of_two"
        assert len(ranking.ranked) == 2 and set(ranking.scores) == {r.id for r in ranking.ranked}
        first, second = ranking.ranked
        assert first.inflight is not None and second.inflight is not None
        assert first.inflight < second.inflight
        sampled_pairs.add(frozenset((first.id, second.id)))
    # It really samples: many different pairs show up, so the check above is not vacuous.
    assert len(sampled_pairs) > 10


def test_power_of_two_is_reproducible_under_a_seed() -> None:
    rows = [row(f"i{k}", inflight=k % 3) for k in range(10)]

    def run(seed: int) -> list[tuple[str, ...]]:
        rng, rr = random.Random(seed), RoundRobin()
        return [
            tuple(r.id for r in power_of_two(rows, Weights(), rr, rng).ranked) for _ in range(50)
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_power_of_two_with_two_or_fewer_uses_them_all() -> None:
    rows = [row("a", inflight=4), row("b", inflight=1)]
    ranking = power_of_two(rows, Weights(), RoundRobin(), random.Random(0))
    assert [r.id for r in ranking.ranked] == ["b", "a"]
    assert power_of_two([], Weights(), RoundRobin(), random.Random(0)).choice is None


def test_rank_dispatches_by_name_and_rejects_unknown() -> None:
    rows = [row("a", inflight=1), row("b", inflight=0)]
    for name in ("least_load", "round_robin", "power_of_two"):
        ranking = rank(name, rows, Weights(), RoundRobin(), random.Random(0))
        assert isinstance(ranking, Ranking) and ranking.strategy == name
    with pytest.raises(ValueError, match="unknown strategy"):
        rank("fastest", rows, Weights(), RoundRobin(), random.Random(0))


def test_eligible_keeps_alive_rows_of_the_role() -> None:
    rows = [
        row("a"),
        row("b", alive=False),
        row("c", role="prefill"),
        row("d", role="decode"),
    ]
    assert [r.id for r in eligible(rows)] == ["a"]
    assert [r.id for r in eligible(rows, role="prefill")] == ["c"]
    assert least_load([], Weights(), RoundRobin()).choice is None


# ---------------------------------------------------------------- prefill_ms


def timed_row(iid: str, backlog_ms: int) -> InstanceLoad:
    """A candidate with a timing model (0.1 ms per prompt token) and some backlog."""
    spec = InstanceSpec(
        id=iid,
        url="http://127.0.0.1:9000",
        prefill_ms_per_token=0.1,
        prefill_overhead_ms=0.0,
        decode_ms_per_token=10.0,
    )
    return row(iid, spec=spec, predicted_total_backlog_ms=backlog_ms, prefill_free_in_ms=backlog_ms)


def test_prefill_ms_counts_the_work_a_request_adds_not_only_its_wait() -> None:
    """i0 holds 10,000 of the 12,000 prompt tokens (1,000 ms of prefill saved) but is
    1,500 ms busier: the request itself waits less on the idle i1 (1,200 < 1,700 ms),
    yet there it adds 1,200 ms of prefill that every later request waits behind,
    against 200 ms on i0. ttft_ms alone sends it away (and copies the prefix into a
    second cache); with prefill_ms weighed too, it stays with its cache."""
    rows = [timed_row("i0", 1500), timed_row("i1", 0)]
    request = RequestShape(12_000, 16, {"i0": 10_000})
    wait_only = Weights(backlog_ms=0.0, ttft_ms=0.2)
    with_work = Weights(backlog_ms=0.0, ttft_ms=0.2, prefill_ms=0.2)
    away = least_load(rows, wait_only, RoundRobin(), request=request).choice
    assert away is not None and away.id == "i1"
    ranking = least_load(rows, with_work, RoundRobin(), request=request)
    assert ranking.choice is not None and ranking.choice.id == "i0"
    assert ranking.scores["i0"].components["prefill_ms"] == 200
    assert ranking.scores["i1"].components["prefill_ms"] == 1200
    # Without a cache credit it is the same on every candidate: the order is the load's.
    plain = least_load(rows, with_work, RoundRobin(), request=RequestShape(12_000, 16))
    assert plain.choice is not None and plain.choice.id == "i1"


def test_prefill_ms_is_missing_without_a_timing_model() -> None:
    rows = [row("a", **NO_PREDICTED), row("b", **NO_PREDICTED)]
    scores = score_rows(rows, Weights(prefill_ms=1.0), request=RequestShape(100, 1))
    assert scores["a"].components["prefill_ms"] is None
    assert "prefill_ms" not in scores["a"].weighted_components


def test_lazy_loads_build_a_row_only_when_read_and_index_as_a_list() -> None:
    rows = [row(f"i{k}") for k in range(4)]
    built: list[int] = []

    def build(j: int) -> InstanceLoad:
        built.append(j)
        return rows[j]

    loads = LazyLoads([r.id for r in rows], build)
    assert ranked_ids(loads) == ["i0", "i1", "i2", "i3"] and built == []
    assert loads[-1] is rows[3] and loads[1] is rows[1]
    assert loads[1:3] == rows[1:3] and list(loads) == rows
    assert sorted(set(built)) == [0, 1, 2, 3] and built.count(1) == 1  # each built once
    with pytest.raises(IndexError):
        loads[4]
    assert ranked_ids(rows) == ["i0", "i1", "i2", "i3"]
