"""App keys and the small in-memory state one node keeps (nothing here is shared)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from coordinator import Coordinator
from proxy_node.config import NodeConfig
from proxy_node.health import PassiveHealth
from proxy_node.metrics import NodeMetrics

INITIAL_OUTPUT_TOKENS = 256.0  # expected output before anything was observed
DRAIN_TIMEOUT_S = 5.0  # at shutdown, how long pending releases may still take
OUTPUT_EMA_ALPHA = 0.05  # weight of one observation: follows drift, ignores outliers

CONFIG = web.AppKey("config", NodeConfig)
COORDINATOR = web.AppKey("coordinator", Coordinator)
SESSION = web.AppKey("session", aiohttp.ClientSession)
METRICS = web.AppKey("metrics", NodeMetrics)
HEALTH = web.AppKey("health", PassiveHealth)
# On the control app: the service app whose Coordinator, metrics and state it shares.
SERVICE_APP = web.AppKey("service_app", web.Application)


@dataclass
class NodeState:
    """Per-node memory: the output-length average, the models cache, helper tasks, drain."""

    expected_output: float = INITIAL_OUTPUT_TOKENS
    observed_outputs: int = 0
    models: list[dict[str, Any]] = field(default_factory=list)
    models_at: float = -1e9  # loop time of the last models refresh
    models_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # One reserve at a time per node (see forwarding.Exchange._decide).
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False  # set on SIGTERM: /healthz answers 503 so balancers stop sending

    def expected_output_tokens(self) -> int:
        """The running average of observed output lengths, as a whole token count."""
        return max(1, round(self.expected_output))

    def observe_output(self, tokens: int) -> None:
        """Fold one observed output length into the running average."""
        if tokens <= 0:
            return
        self.observed_outputs += 1
        self.expected_output += OUTPUT_EMA_ALPHA * (tokens - self.expected_output)

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
            # A helper's failure was already logged by the helper itself.
            with suppress(asyncio.CancelledError, Exception):
                await task


STATE = web.AppKey("state", NodeState)


def service_of(app: web.Application) -> web.Application:
    """The service app holding the shared state (itself, or the one a control app serves)."""
    return app[SERVICE_APP] if SERVICE_APP in app else app
