"""App keys and the small in-memory state one node keeps (nothing here is shared)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from coordinator import Coordinator
from coordinator.tasks import stop_task
from proxy_node.config import NodeConfig
from proxy_node.health import PassiveHealth
from proxy_node.metrics import NodeMetrics
from proxy_node.scrape import SharedRender

DRAIN_TIMEOUT_S = 5.0  # at shutdown, how long pending releases may still take

CONFIG = web.AppKey("config", NodeConfig)
COORDINATOR = web.AppKey("coordinator", Coordinator)
SESSION = web.AppKey("session", aiohttp.ClientSession)
METRICS = web.AppKey("metrics", NodeMetrics)
HEALTH = web.AppKey("health", PassiveHealth)
SCRAPES = web.AppKey("scrapes", SharedRender)  # /metrics renders, shared by scrapes
# On the control app: the service app whose Coordinator, metrics and state it shares.
SERVICE_APP = web.AppKey("service_app", web.Application)


@dataclass
class NodeState:
    """Per-node memory: the models cache, helper tasks and the drain flag.

    The expected output length is the pool's, learned fleet-wide by the Coordinator.
    """

    models: list[dict[str, Any]] = field(default_factory=list)
    models_at: float = -1e9  # loop time of the last models refresh
    models_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # One reserve at a time per node (see forwarding.Exchange._decide).
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False  # set on SIGTERM: /healthz answers 503 so balancers stop sending

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a fire-and-forget coroutine, keeping a reference until it ends."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Let the helper tasks (releases, first-token marks) finish; cancel stragglers."""
        tasks = list(self.tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        for task in tasks:
            # Again if a cancel got swallowed; a helper's failure was logged by the helper.
            await stop_task(task)


STATE = web.AppKey("state", NodeState)


def service_of(app: web.Application) -> web.Application:
    """The service app holding the shared state (itself, or the one a control app serves)."""
    return app[SERVICE_APP] if SERVICE_APP in app else app
