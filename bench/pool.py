"""A pool of idle, identical instances for the benchmarks (no engine behind them)."""

from __future__ import annotations

from coordinator.coordinator import Coordinator
from coordinator.models import InstanceSpec
from coordinator.settings import Settings


async def register_idle_pool(
    url: str, pool: str, instances: int, settings: Settings, *, max_slots: int = 0
) -> None:
    """Register `instances` identical instances (H100-like 7-8B timing) in `pool`."""
    c = await Coordinator.connect(
        url, pool=pool, node_id="bench-setup", settings=settings, background=False
    )
    try:
        for i in range(instances):
            await c.register_instance(
                InstanceSpec(
                    id=f"inst-{i:04d}",
                    url=f"http://127.0.0.1:{20000 + i}",
                    max_slots=max_slots,
                    prefill_ms_per_token=0.08,
                    prefill_overhead_ms=10.0,
                    decode_ms_per_token=16.0,
                )
            )
    finally:
        await c.close()
