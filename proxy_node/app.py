"""The proxy node's aiohttp applications: the service plane and the control plane.

`create_app` builds the service plane and owns every resource (one cleanup_ctx each:
the Coordinator and its Redis client, the shared ClientSession, the static-instance
keep-alive task, the hint scraper task). `create_control_app` builds the control
plane, served on its own port, over the same Coordinator: start it after the service
app and stop it before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from coordinator import Coordinator
from coordinator.connection import eviction_warning
from coordinator.outliers import OutlierView
from coordinator.settings import Weights
from coordinator.snapshot import Snapshot
from coordinator.strategies import eligible, score_rows
from coordinator.tasks import stop_task
from proxy_node import control, hints, static
from proxy_node.config import NodeConfig
from proxy_node.dashboard import add_dashboard_routes
from proxy_node.errors import json_errors
from proxy_node.forwarding import completions
from proxy_node.health import PassiveHealth
from proxy_node.metrics import NodeMetrics
from proxy_node.scrape import SharedRender
from proxy_node.state import (
    CONFIG,
    COORDINATOR,
    HEALTH,
    METRICS,
    SCRAPES,
    SERVICE_APP,
    SESSION,
    STATE,
    NodeState,
    service_of,
)
from proxy_node.views import selection_exclusions

log = logging.getLogger(__name__)

MODELS_CACHE_S = 5.0  # how long the union of the engines' /v1/models is reused
MODELS_TIMEOUT_S = 2.0  # one engine's /v1/models; a slow engine is left out
MODELS_CONCURRENCY = 16  # engines asked for their /v1/models at once
MODELS_DEADLINE_S = 4.0  # for all of them: a pool of slow engines cannot hold /v1/models
BODY_SLACK_BYTES = 64 * 1024  # aiohttp's own cap sits above ours so we answer 413 as JSON


INJECTED = web.AppKey("coordinator_injected", bool)


def package_version() -> str:
    """The installed package's version (for /metrics and logs)."""
    try:
        return version("llm-load-coordinator")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(config: NodeConfig, coordinator: Coordinator | None = None) -> web.Application:
    """The service plane. An injected Coordinator is used as is and not closed on cleanup."""
    app = web.Application(
        client_max_size=config.max_body_bytes + BODY_SLACK_BYTES, middlewares=[json_errors]
    )
    app[CONFIG] = config
    app[STATE] = NodeState()
    app[INJECTED] = coordinator is not None
    if coordinator is not None:
        app[COORDINATOR] = coordinator
    app.cleanup_ctx.append(_coordinator_ctx)
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_static_instances_ctx)
    app.cleanup_ctx.append(_hint_scraper_ctx)
    app.cleanup_ctx.append(_passive_health_ctx)
    app[SCRAPES] = SharedRender(partial(_metrics_body, app))  # /metrics renders, shared
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def create_control_app(service: web.Application) -> web.Application:
    """The control plane: registration, heartbeats, debug views, over the service's state."""
    config = service[CONFIG]
    app = web.Application(middlewares=[json_errors, control.require_token(config.token)])
    app[SERVICE_APP] = service
    control.add_routes(app)
    add_dashboard_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


# ---------------------------------------------------------------------- resources


async def _coordinator_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    if not app[INJECTED]:
        app[COORDINATOR] = await Coordinator.connect(
            config.redis_url,
            pool=config.pool,
            node_id=config.node_id,
            settings=config.settings,
            background=False,
        )
    coordinator = app[COORDINATOR]
    warning = await eviction_warning(coordinator.redis)
    if warning is not None:
        log.warning("%s", warning)
    coordinator.start_background()
    app[METRICS] = NodeMetrics(coordinator.node_id, coordinator.pool, package_version())
    app[METRICS].bind(coordinator)
    log.info(
        "node %s serving pool %s (%s)",
        coordinator.node_id,
        coordinator.pool,
        coordinator.coordination,
    )
    yield
    await app[STATE].drain()
    if not app[INJECTED]:
        # Drained: what is left would only wait out the lease before a peer reaps it.
        await coordinator.retire()
        await coordinator.close()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    # No connection cap: a pool of streaming requests would otherwise queue inside
    # the connector, invisible to the coordinator. auto_decompress=False passes the
    # engine's bytes through unchanged, Content-Encoding included.
    # Accept-Encoding is never added by aiohttp: only a client that asked gets gzip.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("Accept-Encoding",)
    ) as session:
        app[SESSION] = session
        yield


async def _static_instances_ctx(app: web.Application) -> AsyncIterator[None]:
    config, coordinator = app[CONFIG], app[COORDINATOR]
    instances = static.static_instances(config.instances, config.instance_model)
    if not instances:
        yield
        return
    interval = coordinator.settings.heartbeat_interval_ms / 1000
    await static.maintain(
        coordinator, app[SESSION], instances, min(interval, static.PROBE_TIMEOUT_S)
    )
    task = asyncio.create_task(
        static.keep_alive(coordinator, app[SESSION], instances, interval), name="static-instances"
    )
    yield
    await stop_task(task)


async def _hint_scraper_ctx(app: web.Application) -> AsyncIterator[None]:
    interval = app[CONFIG].scrape_interval_s
    if interval <= 0:
        yield
        return
    task = asyncio.create_task(
        hints.scrape_loop(app[COORDINATOR], app[SESSION], interval), name="hint-scraper"
    )
    yield
    await stop_task(task)


async def _passive_health_ctx(app: web.Application) -> AsyncIterator[None]:
    health = PassiveHealth(app[COORDINATOR], app[CONFIG].outlier_policy, app[METRICS])
    app[HEALTH] = health
    # Also with ejection off: operators' cordons come the same way.
    task = asyncio.create_task(health.refresh_loop(), name="passive-health")
    yield
    await stop_task(task)


async def _metrics_body(app: web.Application) -> bytes:
    """One /metrics render: the pool read now, scored and written out."""
    coordinator = app[COORDINATOR]
    snap = await coordinator.snapshot()
    outliers = await app[HEALTH].refresh()
    # Scoring and writing out every instance's series takes the CPU for 60 ms at 1,000
    # instances, 0.75 s at 10,000: in a thread, so that the event loop goes on serving
    # requests and reading Redis replies within their timeout meanwhile.
    return await asyncio.to_thread(
        render_metrics, app[METRICS], snap, outliers, coordinator.settings.weights
    )


# ---------------------------------------------------------------------- handlers


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: node identity, coordination state, alive instances.

    503 with status `draining` once the node is shutting down (readiness fails).
    """
    service = service_of(request.app)
    coordinator = service[COORDINATOR]
    alive = await coordinator.alive_ids()
    ejected = service[HEALTH].ejected_ids()
    cordoned = service[HEALTH].cordoned_ids()
    draining = service[STATE].draining
    return web.json_response(
        {
            "status": "draining" if draining else "ok",
            "node_id": coordinator.node_id,
            "pool": coordinator.pool,
            "coordination": coordinator.coordination,
            # another process renews this node id's lease too (docs/reliability.md)
            "node_id_shared": coordinator.node_id_shared,
            # alive: the engine answered within the instance TTL (docs/reliability.md)
            "alive_instances": len(alive),
            "ejected_instances": len(alive & ejected),
            "cordoned_instances": len(alive & cordoned),
        },
        status=503 if draining else 200,
    )


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text, pressure gauges from a snapshot read after the
    request came (one render at a time, shared by the scrapes waiting: proxy_node/scrape.py)."""
    body = await service_of(request.app)[SCRAPES].get()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def render_metrics(
    node_metrics: NodeMetrics, snap: Snapshot, outliers: OutlierView, weights: Weights
) -> bytes:
    """The /metrics text for this snapshot (off the event loop: it only reads `snap`)."""
    # Scored directly (not through rank()): a scrape must not advance the rotation.
    skipped = selection_exclusions(snap, outliers)
    candidates = [row for row in eligible(snap.rows) if row.id not in skipped]
    node_metrics.observe_snapshot(snap, score_rows(candidates, weights), outliers)
    return node_metrics.render()


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the union of the alive instances' models (cached briefly)."""
    app = request.app
    state = app[STATE]
    loop = asyncio.get_running_loop()
    async with state.models_lock:
        if loop.time() - state.models_at > MODELS_CACHE_S:
            state.models = await _collect_models(app[COORDINATOR], app[SESSION])
            state.models_at = loop.time()
        data = list(state.models)
    return web.json_response({"object": "list", "data": data})


async def _collect_models(
    coordinator: Coordinator, session: aiohttp.ClientSession
) -> list[dict[str, Any]]:
    snap = await coordinator.snapshot()
    alive = [row for row in snap.rows if row.alive]
    # A few at a time: all of a large pool's at once held the event loop for 120 ms at
    # 1,000 engines, every MODELS_CACHE_S while clients poll /v1/models.
    bound = asyncio.Semaphore(MODELS_CONCURRENCY)

    async def fetch(url: str) -> list[dict[str, Any]]:
        async with bound:
            return await static.engine_models(session, url, MODELS_TIMEOUT_S)

    tasks = [asyncio.ensure_future(fetch(row.url)) for row in alive if row.spec.model is None]
    if tasks:  # engines still queued or answering by the deadline are left out this time
        _, late = await asyncio.wait(tasks, timeout=MODELS_DEADLINE_S)
        for task in late:
            task.cancel()
    fetched = await asyncio.gather(*tasks, return_exceptions=True)
    seen: dict[str, dict[str, Any]] = {}
    for row in alive:
        if row.spec.model is not None:
            seen.setdefault(
                row.spec.model,
                {"id": row.spec.model, "object": "model", "created": 0, "owned_by": "coordinator"},
            )
    for result in fetched:
        if isinstance(result, BaseException):
            log.debug("fetching models failed: %r", result)
            continue
        for entry in result:
            seen.setdefault(entry["id"], entry)
    return sorted(seen.values(), key=lambda m: str(m["id"]))
