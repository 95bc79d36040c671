"""Named weights: `seed` is exactly DESIGN.md §3's formula; `ttft` is the default."""

from __future__ import annotations

import pytest

from coordinator.errors import InvalidArgumentError
from coordinator.models import RequestShape
from coordinator.settings import DEFAULT_WEIGHTS, Settings, Weights
from coordinator.strategies import score_rows
from tests.library.test_strategies import row


def test_seed_preset_is_the_design_formula() -> None:
    """DESIGN.md §3: inflight x1; running x1, waiting x0.25, queue x0.25;
    pending_prefill x1, active_decode x0.5, backlog_ms x0.001; nothing request-aware."""
    seed = Weights.preset("seed")
    assert seed == Weights()
    r = row(
        "a",
        inflight=3,
        engine_running=2.0,
        engine_waiting=4.0,
        queue_depth=8.0,
        pending_prefill_count=1,
        active_decode_count=2,
        predicted_total_backlog_ms=700,
    )
    by_hand = 3 * 1.0 + 2.0 * 1.0 + 4.0 * 0.25 + 8.0 * 0.25 + 1 * 1.0 + 2 * 0.5 + 700 * 0.001
    request = RequestShape(4000, 10)
    assert score_rows([r], seed)["a"].total == pytest.approx(by_hand)
    assert score_rows([r], seed, request=request)["a"].total == pytest.approx(by_hand)


def test_default_is_the_ttft_preset() -> None:
    assert DEFAULT_WEIGHTS == "ttft"
    assert Settings().weights == Weights.preset("ttft")
    ttft = Weights.preset("ttft")
    assert (ttft.backlog_ms, ttft.ttft_ms, ttft.prefill_ms) == (0.0, 0.2, 0.2)
    ms_valued = ("backlog_ms", "ttft_ms", "prefill_ms")
    assert {k: v for k, v in ttft.as_dict().items() if k not in ms_valued} == {
        k: v for k, v in Weights().as_dict().items() if k not in ms_valued
    }


def test_presets_parse_with_overrides() -> None:
    assert Weights.parse("seed") == Weights()
    assert Weights.parse("ttft,inflight=2") == Weights(
        backlog_ms=0.0, ttft_ms=0.2, prefill_ms=0.2, inflight=2.0
    )
    assert Weights.parse("backlog_ms=0.05") == Weights(backlog_ms=0.05)  # on the seed's
    with pytest.raises(InvalidArgumentError, match="unknown weights preset"):
        Weights.parse("fastest")
    with pytest.raises(InvalidArgumentError):
        Weights.parse("seed,ttft")
    assert Settings.from_env({"COORD_WEIGHTS": "seed"}).weights == Weights()
