"""JSON views shared by the control plane and the operator tooling (`coordinator inspect`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from coordinator.models import HINT_NAMES, InstanceLoad
from coordinator.outliers import OutlierState, OutlierView
from coordinator.settings import Settings
from coordinator.snapshot import Snapshot
from coordinator.strategies import Ranking, eligible, ranked_ids


def selection_exclusions(snapshot: Snapshot, outliers: OutlierView | None) -> frozenset[str]:
    """The instances selection skips: the cordoned, and the ejected unless they are all
    that is left alive."""
    if outliers is None:
        return frozenset()
    cordoned = outliers.cordoned_ids()
    ejected = outliers.ejected_ids(snapshot.now_ms or None) | cordoned
    if all(row.id in ejected for row in eligible(snapshot.rows)):
        return cordoned
    return ejected


def shown_rows(
    snapshot: Snapshot, ranking: Ranking, limit: int, ids: Collection[str] = ()
) -> tuple[list[InstanceLoad], bool]:
    """The rows a view of at most `limit` instances shows, in the snapshot's order,
    and whether the limit left any out.

    With `ids`, only those instances; beyond `limit`, the best ranked first, then the
    unranked (dead, ejected or excluded) by id: what an operator looks at first in a
    pool too large to show whole.
    """
    rows = [row for row in snapshot.rows if row.id in ids] if ids else list(snapshot.rows)
    if len(rows) <= limit:
        return rows, False
    positions = {iid: i for i, iid in enumerate(ranked_ids(ranking.ranked))}
    unranked = len(positions)
    best = sorted(rows, key=lambda row: (positions.get(row.id, unranked), row.id))[:limit]
    kept = {row.id for row in best}
    return [row for row in rows if row.id in kept], True


def instance_loads_view(
    snapshot: Snapshot,
    ranking: Ranking,
    settings: Settings,
    node_id: str,
    pool: str,
    outliers: OutlierView | None = None,
    expected_cached: Mapping[str, int] | None = None,
    index_tokens: Mapping[str, int] | None = None,
    rows: Sequence[InstanceLoad] | None = None,
    truncated: bool = False,
) -> dict[str, Any]:
    """What `/debug/instance_loads` serves: the snapshot and the scores selection used.

    `instances` lists `rows` (default: every instance of the snapshot, dead ones too,
    with `rank` None); `rank` is the position in the strategy's ranking,
    `least_load_score` the Score it was ranked by (None for a candidate the strategy
    did not score, e.g. outside power_of_two's sample). `prefix` shows the prefix
    index: `expected_cached_tokens` of the last request this node routed (what its
    ranking took off each predicted prefill) and `index_tokens`, what the shared index
    believes the instance caches. `summary` counts the whole pool, shown or not;
    `truncated` says a limit left rows out (`shown_rows`). Numbers and names only: never a
    request payload.
    """
    shown = snapshot.rows if rows is None else rows
    positions = {iid: i for i, iid in enumerate(ranked_ids(ranking.ranked))}
    now = outliers.now_ms if outliers is not None else snapshot.now_ms
    ejected = outliers.ejected_ids(now) if outliers is not None else frozenset()
    cordoned = outliers.cordoned_ids() if outliers is not None else frozenset()
    instances = []
    for row in shown:
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
        "summary": {
            "instances": len(snapshot.rows),
            "alive": sum(1 for row in snapshot.rows if row.alive),
            "ejected": sum(1 for row in snapshot.rows if row.alive and row.id in ejected),
            "cordoned": sum(1 for row in snapshot.rows if row.alive and row.id in cordoned),
            "inflight": sum(row.inflight or 0 for row in snapshot.rows),
        },
        "truncated": truncated,
        "instances": instances,
    }
