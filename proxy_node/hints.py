"""Engine hints: scrape the engines' Prometheus `/metrics` and store them (never liveness).

Each alive instance is scraped by exactly one live node per interval: the node that
wins a rendezvous (highest-random-weight) hash of the instance id over the live node
ids. Every node computes the same owner from the same lease set, without talking to
the others, and a node joining or leaving moves only its own share of instances.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from coordinator import Coordinator
from coordinator.errors import CoordinatorError
from coordinator.models import InstanceLoad
from coordinator.tasks import raise_if_cancelling

log = logging.getLogger(__name__)

MAX_SCRAPE_TIMEOUT_S = 2.0  # one scrape; a slow engine must not stall the round
MAX_METRICS_BYTES = 4 * 1024 * 1024  # an engine's /metrics larger than this is skipped

# Prometheus metric family -> hint name. Values of one family are summed over its
# label sets (vLLM labels by model and, with data parallelism, by engine).
ENGINE_METRICS: dict[str, str] = {
    "vllm:num_requests_running": "engine_running",
    "vllm:num_requests_waiting": "engine_waiting",
    "sglang:num_running_reqs": "engine_running",
    "sglang:num_queue_reqs": "engine_waiting",
}


def rendezvous_owner(instance_id: str, node_ids: Sequence[str]) -> str:
    """The node responsible for an instance: the highest hash of (node, instance)."""
    if not node_ids:
        raise ValueError("no node ids")
    return max(node_ids, key=lambda node: (_weight(node, instance_id), node))


def _weight(node_id: str, instance_id: str) -> int:
    # A stable hash: Python's hash() differs per process, so nodes would disagree.
    digest = hashlib.blake2b(f"{node_id}\x00{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Hints found in a Prometheus text exposition (absent metrics are simply missing)."""
    hints: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        hint = ENGINE_METRICS.get(family.name)
        if hint is None:
            continue
        for sample in family.samples:
            if sample.name == family.name and math.isfinite(sample.value) and sample.value >= 0:
                hints[hint] = hints.get(hint, 0.0) + sample.value
    return hints


async def live_node_ids(coordinator: Coordinator, now_ms: int) -> list[str]:
    """Node ids whose lease (score = deadline, Redis ms) has not expired at now_ms."""
    nodes = await coordinator.redis.zrangebyscore(coordinator.keys.column("nodes"), now_ms, "+inf")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in nodes]


async def scrape_instance(
    session: aiohttp.ClientSession, row: InstanceLoad, timeout_s: float, node_id: str
) -> dict[str, float]:
    """Fetch and parse one engine's /metrics."""
    url = row.url.rstrip("/") + "/metrics"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # The node's session does not decompress, and prometheus_client gzips when asked.
    # X-Node-Id tells an engine's operator which node scrapes it.
    headers = {"Accept-Encoding": "identity", "X-Node-Id": node_id}
    async with session.get(url, timeout=timeout, headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(f"{url} answered {resp.status}")
        raw = await resp.content.read(MAX_METRICS_BYTES + 1)
        if len(raw) > MAX_METRICS_BYTES:
            raise ValueError(f"{url} is larger than {MAX_METRICS_BYTES} bytes")
    return parse_engine_metrics(raw.decode("utf-8", "replace"))


async def scrape_once(
    coordinator: Coordinator, session: aiohttp.ClientSession, timeout_s: float
) -> int:
    """Scrape this node's share of the alive instances; returns how many stored hints."""
    snap = await coordinator.snapshot()
    if snap.coordination != "ok":
        return 0  # hints could not be stored anyway
    try:
        nodes = await live_node_ids(coordinator, snap.now_ms)
    except (RedisError, OSError) as exc:
        log.debug("hint scrape skipped: cannot read node leases: %s", exc)
        return 0
    if coordinator.node_id not in nodes:
        nodes.append(coordinator.node_id)  # our lease may not be written yet
    mine = [
        row
        for row in snap.rows
        if row.alive and rendezvous_owner(row.id, nodes) == coordinator.node_id
    ]
    results = await asyncio.gather(
        *(scrape_instance(session, row, timeout_s, coordinator.node_id) for row in mine),
        return_exceptions=True,
    )
    stored = 0
    for row, result in zip(mine, results, strict=True):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            log.debug("scraping %s (%s) failed: %r", row.id, row.url, result)
            continue
        if not result:
            continue  # no engine metric we know
        try:
            # Hints only: a scrape proves /metrics answers, not that the engine serves
            # requests, so liveness stays with the engine's heartbeats (docs/reliability.md).
            await coordinator.store_hints(row.id, result)
        except CoordinatorError as exc:  # unregistered meanwhile, or Redis went away
            log.debug("storing hints of %s failed: %s", row.id, exc)
            continue
        stored += 1
    return stored


async def scrape_loop(
    coordinator: Coordinator, session: aiohttp.ClientSession, interval_s: float
) -> None:
    """Scrape every `interval_s` until cancelled; one failing round never ends the loop."""
    timeout_s = min(interval_s, MAX_SCRAPE_TIMEOUT_S)
    while True:
        try:
            await scrape_once(coordinator, session, timeout_s)
        except (CoordinatorError, RedisError, OSError) as exc:
            log.debug("hint scrape round failed: %s", exc)
        except Exception:
            log.exception("hint scrape round failed")
        raise_if_cancelling()  # redis-py may have swallowed our cancel (coordinator.tasks)
        await asyncio.sleep(interval_s)
