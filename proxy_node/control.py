"""The control plane: instance registration and heartbeats, and the debug views.

Writes (POST, PUT, PATCH, DELETE) need `Authorization: Bearer <token>` when the node
has a token; reads stay open so dashboards and probes need no secret.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Sequence
from contextlib import suppress
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from redis.exceptions import RedisError

from coordinator import Coordinator
from coordinator.errors import (
    CoordinationUnavailableError,
    CoordinatorError,
    EpochFencedError,
    InvalidArgumentError,
    UnknownInstanceError,
)
from coordinator.keys import ID_RE
from coordinator.models import HINT_NAMES, InstanceLoad, InstanceSpec
from coordinator.settings import STRATEGIES
from coordinator.snapshot import Snapshot
from coordinator.strategies import Ranking
from proxy_node.config import instance_id_for
from proxy_node.errors import Handler, json_error
from proxy_node.scrape import SharedRenders
from proxy_node.state import CONFIG, COORDINATOR, HEALTH, SERVICE_APP
from proxy_node.views import instance_loads_view, selection_exclusions, shown_rows

log = logging.getLogger(__name__)

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_RESERVATIONS_LIMIT = 1000  # rows of /debug/reservations unless ?limit= says otherwise
MAX_RESERVATIONS_LIMIT = 100_000  # a debug read must stay bounded
DEFAULT_INSTANCES_LIMIT = 1000  # instances of /debug/instance_loads unless ?limit= says otherwise
MAX_INSTANCES_LIMIT = 100_000


def require_token(token: str | None) -> Any:
    """Middleware: control-plane writes need the bearer token (when one is set)."""
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.method in WRITE_METHODS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return json_error(
                    401,
                    "missing or wrong bearer token",
                    "unauthorized",
                    {"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return middleware


LOAD_VIEWS = web.AppKey("load_views", SharedRenders)  # /debug/instance_loads renders


def add_routes(app: web.Application) -> None:
    """Register the control-plane routes on an app."""
    app[LOAD_VIEWS] = SharedRenders()
    app.router.add_post("/v1/instances", register)
    app.router.add_get("/v1/instances", list_instances)
    app.router.add_post("/v1/instances/{instance_id}/heartbeat", heartbeat)
    app.router.add_delete("/v1/instances/{instance_id}", unregister)
    app.router.add_post("/v1/instances/{instance_id}/cordon", cordon)
    app.router.add_delete("/v1/instances/{instance_id}/cordon", cordon)
    app.router.add_get("/debug/instance_loads", instance_loads)
    app.router.add_get("/debug/reservations", reservations)


def _coordinator(request: web.Request) -> Coordinator:
    return request.app[SERVICE_APP][COORDINATOR]


async def _json_body(request: web.Request, *, optional: bool = False) -> Any:
    """The decoded body; raises a 400 response for malformed JSON, 408 for a stalled body."""
    timeout_s = request.app[SERVICE_APP][CONFIG].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        # The unread rest of the body must not be parsed as a request: the connection ends.
        stalled = json_error(
            408, f"request body not received within {timeout_s:g} s", "body_timeout", closing=True
        )
        raise _Reject(stalled) from None
    except web.RequestPayloadError:  # e.g. a body that fails its Content-Encoding
        unreadable = json_error(400, "unreadable request body", "invalid_body", closing=True)
        raise _Reject(unreadable) from None
    if optional and not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _Reject(json_error(400, f"malformed JSON body: {exc}", "invalid_json")) from None


class _Reject(Exception):
    """Carries an error response out of a helper."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def _unavailable(exc: Exception) -> web.Response:
    return json_error(
        503, f"coordination unavailable: {exc}", "coordination_unavailable", {"Retry-After": "1"}
    )


async def register(request: web.Request) -> web.Response:
    """POST /v1/instances[?change_url=true]: register (or update) an instance.

    Moving a registered id to another URL would send its traffic there, so it must be
    asked for (`?change_url=true`, or a higher epoch: an engine restarted elsewhere)
    and is logged; with a token, like every write, it is authenticated. An instance
    this node serves statically (`--instance`) never moves.
    """
    coordinator = _coordinator(request)
    try:
        spec = InstanceSpec.from_dict(await _json_body(request))
        refused = await _check_url(request, coordinator, spec)
        if refused is not None:
            return refused
        result = await coordinator.register_instance(spec)
    except _Reject as reject:
        return reject.response
    except (InvalidArgumentError, OverflowError) as exc:  # Overflow: a JSON int past float range
        return json_error(422, str(exc), "invalid_instance")
    except EpochFencedError as exc:
        return json_error(409, str(exc), "epoch_fenced")
    s = coordinator.settings
    return web.json_response(
        {
            "instance_id": result.instance_id,
            "epoch": result.epoch,
            "status": result.status,
            "voided_reservations": result.voided_reservations,
            "heartbeat_interval_s": s.heartbeat_interval_ms / 1000,
            "ttl_s": s.instance_ttl_ms / 1000,
        },
        status=201,
    )


async def _check_url(
    request: web.Request, coordinator: Coordinator, spec: InstanceSpec
) -> web.Response | None:
    """Refuse a registration that would move an instance to another URL without asking."""
    if urlsplit(spec.url).path.rstrip("/").endswith("/v1"):
        return json_error(
            422,
            f"url must be the engine's base URL, without /v1 (got {spec.url!r}): the node "
            "appends the client's path, e.g. /v1/chat/completions",
            "invalid_instance",
        )
    config = request.app[SERVICE_APP][CONFIG]
    static = {instance_id_for(url): url for url in config.instances}
    if spec.id in static and static[spec.id] != spec.url.rstrip("/"):
        return json_error(
            409,
            f"instance {spec.id} is served statically by this node at {static[spec.id]}; "
            "its URL cannot be changed by a registration",
            "static_instance",
        )
    with suppress(CoordinatorError):
        await coordinator.refresh()
    current = (await coordinator.snapshot()).by_id().get(spec.id)
    if current is None or current.url == spec.url:
        return None
    asked = request.query.get("change_url", "").lower() in ("1", "true", "yes")
    restarted = spec.epoch > current.epoch  # a new process, declaring itself
    if not (asked or restarted):
        return json_error(
            409,
            f"instance {spec.id} is registered at {current.url}; moving it to {spec.url} "
            "needs ?change_url=true (or a new epoch, from a restarted engine)",
            "url_change",
        )
    log.warning(
        "instance %s moved from %s to %s by %s (%s)",
        spec.id,
        current.url,
        spec.url,
        request.remote,
        "?change_url=true" if asked else f"restarted, epoch {current.epoch} -> {spec.epoch}",
    )
    return None


def _hints_of(body: Any) -> dict[str, Any]:
    """Hints from `{name: n, ...}` or `{"hints": {name: n, ...}}`; raises InvalidArgumentError."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise InvalidArgumentError("a heartbeat body must be a JSON object")
    if "hints" in body:
        rest = set(body) - {"hints"}
        if rest:
            raise InvalidArgumentError(f"unexpected heartbeat fields next to hints: {sorted(rest)}")
        body = body["hints"] if body["hints"] is not None else {}
        if not isinstance(body, dict):
            raise InvalidArgumentError("hints must be a JSON object")
    unknown = set(body) - set(HINT_NAMES)
    if unknown:
        raise InvalidArgumentError(f"unknown hints {sorted(unknown)}; known: {list(HINT_NAMES)}")
    return {k: v for k, v in body.items() if v is not None}


async def heartbeat(request: web.Request) -> web.Response:
    """POST /v1/instances/{id}/heartbeat: liveness plus optional engine hints."""
    instance_id = request.match_info["instance_id"]
    try:
        hints = _hints_of(await _json_body(request, optional=True))
    except _Reject as reject:
        return reject.response
    except InvalidArgumentError as exc:
        return json_error(422, str(exc), "invalid_hints")
    if not ID_RE.fullmatch(instance_id):
        return json_error(404, f"unknown instance {instance_id!r}", "unknown_instance")
    try:
        epoch = await _coordinator(request).heartbeat_instance(instance_id, hints)
    except UnknownInstanceError:
        return json_error(404, f"unknown instance {instance_id!r}: register it", "unknown_instance")
    except (InvalidArgumentError, OverflowError) as exc:  # Overflow: a JSON int past float range
        return json_error(422, str(exc), "invalid_hints")
    except CoordinationUnavailableError as exc:
        return _unavailable(exc)
    return web.json_response({"epoch": epoch})


async def unregister(request: web.Request) -> web.Response:
    """DELETE /v1/instances/{id}: remove an instance (its reservations become void)."""
    instance_id = request.match_info["instance_id"]
    if not ID_RE.fullmatch(instance_id):
        return json_error(404, f"unknown instance {instance_id!r}", "unknown_instance")
    try:
        voided = await _coordinator(request).unregister_instance(instance_id)
    except UnknownInstanceError:
        return json_error(404, f"unknown instance {instance_id!r}", "unknown_instance")
    except InvalidArgumentError as exc:  # incl. a script refusing its arguments
        return json_error(400, str(exc), "invalid_request")
    except CoordinationUnavailableError as exc:
        return _unavailable(exc)
    return web.json_response({"instance_id": instance_id, "voided_reservations": voided})


async def cordon(request: web.Request) -> web.Response:
    """POST /v1/instances/{id}/cordon {"reason": ...}: no node sends the instance new
    requests (the ones in flight finish); DELETE lifts it. Answers the instance's
    requests in flight as Redis has them, so a drain can poll until 0 (503 when Redis
    cannot say: an unknown count is never 0)."""
    instance_id = request.match_info["instance_id"]
    lift = request.method == "DELETE"
    try:
        body = await _json_body(request, optional=True)
    except _Reject as exc:
        return exc.response
    reason = body.get("reason", "") if isinstance(body, dict) else "" if body is None else None
    if not isinstance(reason, str):
        return json_error(400, 'the body must be {"reason": "<text>"} or empty', "invalid_body")
    if lift:
        reason = ""
    if not ID_RE.fullmatch(instance_id):
        return json_error(404, f"unknown instance {instance_id!r}", "unknown_instance")
    coordinator = _coordinator(request)
    try:
        await request.app[SERVICE_APP][HEALTH].cordon(instance_id, reason, lift=lift)
        if lift:
            log.info("instance %s back in rotation (control plane)", instance_id)
        else:
            log.info("instance %s cordoned (control plane): %r", instance_id, reason)
        inflight = (await coordinator.snapshot()).inflight_of(instance_id)
        if inflight is None:
            raise CoordinationUnavailableError("the requests in flight cannot be read")
    except UnknownInstanceError:
        return json_error(404, f"unknown instance {instance_id!r}", "unknown_instance")
    except InvalidArgumentError as exc:
        return json_error(400, str(exc), "invalid_request")
    except CoordinationUnavailableError as exc:
        return _unavailable(exc)
    return web.json_response(
        {
            "instance_id": instance_id,
            "cordoned": not lift,
            "reason": None if lift else reason,
            "inflight": inflight,
        }
    )


async def list_instances(request: web.Request) -> web.Response:
    """GET /v1/instances[?include_dead=true]: registered instances and their pressure."""
    include_dead = request.query.get("include_dead", "false").lower() in ("1", "true", "yes")
    coordinator = _coordinator(request)
    rows = await coordinator.list_instances(include_dead=include_dead)
    health = request.app[SERVICE_APP][HEALTH]
    ejected, cordoned = health.ejected_ids(), health.cordoned_ids()
    return web.json_response(
        {
            "pool": coordinator.pool,
            "coordination": coordinator.coordination,
            "instances": [
                {**row.as_dict(), "ejected": row.id in ejected, "cordoned": row.id in cordoned}
                for row in rows
            ],
        }
    )


async def instance_loads(request: web.Request) -> web.Response:
    """GET /debug/instance_loads[?strategy=][&limit=][&instance=...]: the snapshot and
    the scores selection uses.

    At most `limit` instances (default 1000), the best ranked first; `instance` (may
    repeat) shows only those. The ranking is a preview (it advances no rotation, so
    reading the view never steers routing), and the ranking and the JSON are built in
    a worker thread: at 10,000 instances they take the CPU for about half a second,
    which the event loop must spend serving requests. Requests for the same query
    share renders, one at a time (proxy_node/scrape.py): each gets one that started
    after it came.
    """
    coordinator = _coordinator(request)
    strategy = request.query.get("strategy", coordinator.settings.strategy)
    if strategy not in STRATEGIES:
        return json_error(400, f"strategy must be one of {STRATEGIES}", "invalid_strategy")
    limit = _limit(request, DEFAULT_INSTANCES_LIMIT, MAX_INSTANCES_LIMIT)
    if limit is None:
        return _invalid_limit(MAX_INSTANCES_LIMIT)
    ids = frozenset(request.query.getall("instance", ()))
    view = partial(
        _instance_loads_body, request.app[SERVICE_APP], coordinator, strategy, limit, ids
    )
    body = await request.app[LOAD_VIEWS].get((strategy, limit, ids), view)
    return web.Response(body=body, content_type="application/json")


async def _instance_loads_body(
    service: web.Application,
    coordinator: Coordinator,
    strategy: str,
    limit: int,
    ids: frozenset[str],
) -> bytes:
    """/debug/instance_loads' JSON for one query, from a pool read now."""
    snapshot = await coordinator.snapshot()
    outliers = await service[HEALTH].refresh()
    exclude = selection_exclusions(snapshot, outliers)

    def select() -> tuple[Ranking, list[InstanceLoad], bool]:
        ranking = coordinator.rank(snapshot, strategy, exclude, preview=True)
        return (ranking, *shown_rows(snapshot, ranking, limit, ids))

    ranking, rows, truncated = await asyncio.to_thread(select)
    index_tokens = await _index_tokens(coordinator, snapshot, rows)

    def render() -> bytes:
        view = instance_loads_view(
            snapshot,
            ranking,
            coordinator.settings,
            coordinator.node_id,
            coordinator.pool,
            outliers,
            coordinator.prefix.last_lookup,
            index_tokens,
            rows,
            truncated,
        )
        return json.dumps(view).encode()

    return await asyncio.to_thread(render)


async def _index_tokens(
    coordinator: Coordinator, snapshot: Snapshot, rows: Sequence[InstanceLoad]
) -> dict[str, int]:
    """What the prefix index holds per instance shown; nothing while Redis is
    unreachable."""
    if snapshot.coordination != "ok" or not rows:
        return {}
    try:
        return await coordinator.prefix.index_tokens([(r.id, r.epoch) for r in rows])
    except (RedisError, OSError):
        return {}


async def reservations(request: web.Request) -> web.Response:
    """GET /debug/reservations[?limit=]: live reservations (ids and numbers, no payloads)."""
    coordinator = _coordinator(request)
    limit = _limit(request, DEFAULT_RESERVATIONS_LIMIT, MAX_RESERVATIONS_LIMIT)
    if limit is None:
        return _invalid_limit(MAX_RESERVATIONS_LIMIT)
    rows: list[dict[str, Any]] = []
    truncated = False
    # The snapshot carries the Redis time of the pool's own shard (TIME would not, on
    # a cluster); reading the hash right after keeps the ages consistent with it.
    now_ms = (await coordinator.snapshot()).now_ms
    try:
        key = coordinator.keys.column("reservations")
        async for rid, raw in coordinator.redis.hscan_iter(key, count=500):
            if len(rows) >= limit:
                truncated = True
                break
            rows.append(_reservation_row(str(rid), raw, now_ms))
    except (RedisError, OSError) as exc:
        return _unavailable(exc)
    rows.sort(key=lambda r: (-(r["age_ms"] or 0), r["rid"]))
    return web.json_response(
        {
            "pool": coordinator.pool,
            "generated_at": now_ms,
            "coordination": coordinator.coordination,
            "truncated": truncated,
            "reservations": rows,
        }
    )


def _limit(request: web.Request, default: int, maximum: int) -> int | None:
    """The request's `?limit=`, or None when it is not an integer in 1..maximum."""
    try:
        limit = int(request.query.get("limit", default))
    except ValueError:
        return None
    return limit if 1 <= limit <= maximum else None


def _invalid_limit(maximum: int) -> web.Response:
    return json_error(400, f"limit must be an integer in 1..{maximum}", "invalid_limit")


def _reservation_row(rid: str, raw: Any, now_ms: int) -> dict[str, Any]:
    try:
        rec = json.loads(raw)
    except (TypeError, ValueError):
        rec = {}
    if not isinstance(rec, dict):
        rec = {}
    created = rec.get("created_ms")
    return {
        "rid": rid,
        "instance": rec.get("instance"),
        "node": rec.get("node"),
        "phase": rec.get("phase"),
        "epoch": rec.get("epoch"),
        "age_ms": now_ms - int(created) if isinstance(created, int | float) else None,
    }
