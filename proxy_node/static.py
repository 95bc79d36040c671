"""Static instances (`--instance URL`): registered at start and kept alive by the node.

A static instance has no agent of its own to heartbeat it, so the node that lists it
does: the operator asserts it exists, as with an nginx upstream block. Connection
failures are still handled per request (retry on another instance).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from coordinator import Coordinator, InstanceSpec
from coordinator.errors import CoordinatorError, UnknownInstanceError
from proxy_node.config import instance_id_for

log = logging.getLogger(__name__)


def static_specs(urls: Sequence[str]) -> list[InstanceSpec]:
    """One spec per URL, its id derived from host:port."""
    return [InstanceSpec(id=instance_id_for(url), url=url.rstrip("/")) for url in urls]


async def register_all(coordinator: Coordinator, specs: Sequence[InstanceSpec]) -> None:
    """Register every static instance (degraded mode remembers them locally)."""
    for spec in specs:
        result = await coordinator.register_instance(spec)
        log.info("static instance %s -> %s (%s)", spec.id, spec.url, result.status)


async def keep_alive(
    coordinator: Coordinator, specs: Sequence[InstanceSpec], interval_s: float
) -> None:
    """Heartbeat the static instances until cancelled; re-register any that was lost."""
    while True:
        await asyncio.sleep(interval_s)
        for spec in specs:
            try:
                await coordinator.heartbeat_instance(spec.id)
            except UnknownInstanceError:
                # Redis restarted empty, or someone unregistered it: it is still listed.
                try:
                    await coordinator.register_instance(spec)
                except CoordinatorError as exc:
                    log.debug("re-registering %s failed: %s", spec.id, exc)
            except CoordinatorError as exc:
                log.debug("heartbeat of static instance %s failed: %s", spec.id, exc)
            except Exception:
                log.exception("heartbeat of static instance %s failed", spec.id)
