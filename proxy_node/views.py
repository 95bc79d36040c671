"""JSON views shared by the control plane and the operator tooling (`coordinator inspect`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.models import HINT_NAMES
from coordinator.outliers import OutlierState, OutlierView
from coordinator.settings import Settings
from coordinator.snapshot import Snapshot
from coordinator.strategies import Ranking, eligible


def selection_exclusions(snapshot: Snapshot, outliers: OutlierView | None) -> frozenset[str]:
    """The ejected instances selection skips: none when they are all that is alive."""
    if outliers is None:
        return frozenset()
    ejected = outliers.ejected_ids(snapshot.now_ms or None)
    if not ejected or all(row.id in ejected for row in eligible(snapshot.rows)):
        return frozenset()
    return ejected


def instance_loads_view(
    snapshot: Snapshot,
    ranking: Ranking,
    settings: Settings,
    node_id: str,
    pool: str,
    outliers: OutlierView | None = None,
    expected_cached: Mapping[str, int] | None = None,
    index_tokens: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """What `/debug/instance_loads` serves: the snapshot and the scores selection used.

    Every instance of the snapshot appears (dead ones too, with `rank` None); `rank` is
    the position in the strategy's ranking, `least_load_score` the Score it was ranked
    by (None for a candidate the strategy did not score, e.g. outside power_of_two's
    sample). `prefix` shows the prefix index: `expected_cached_tokens` of the last
    request this node routed (what its ranking took off each predicted prefill) and
    `index_tokens`, what the shared index believes the instance caches. Numbers and
    names only: never a request payload.
    """
    positions = {row.id: i for i, row in enumerate(ranking.ranked)}
    instances = []
    for row in snapshot.rows:
        data = row.as_dict()
        fresh = {name: getattr(row, name) for name in HINT_NAMES}
        data["hints"] = {
            name: {
                "value": fresh[name],
                "age_ms": row.hint_ages_ms[name],
                "fresh": fresh[name] is not None,
            }
            for name in HINT_NAMES
            if name in row.hint_ages_ms
        }
        score = ranking.scores.get(row.id)
        data["least_load_score"] = score.as_dict() if score is not None else None
        data["rank"] = positions.get(row.id)
        now = outliers.now_ms if outliers is not None else snapshot.now_ms
        state = outliers.state(row.id) if outliers is not None else OutlierState(row.id)
        data["outlier"] = state.as_dict(now)
        data["prefix"] = {
            "expected_cached_tokens": (expected_cached or {}).get(row.id, 0),
            "index_tokens": (index_tokens or {}).get(row.id),
        }
        instances.append(data)
    return {
        "generated_at": snapshot.now_ms,
        "version": snapshot.version,
        "coordination": snapshot.coordination,
        "node_id": node_id,
        "pool": pool,
        "strategy": ranking.strategy,
        "weights": settings.weights.as_dict(),
        "hint_ttl_ms": settings.hint_ttl_ms,
        "instance_ttl_ms": settings.instance_ttl_ms,
        "prefix_affinity": settings.prefix_affinity,
        "instances": instances,
    }
