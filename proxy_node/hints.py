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
import re
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from coordinator import Coordinator
from coordinator.errors import CoordinatorError
from coordinator.models import InstanceLoad
from coordinator.tasks import raise_if_cancelling
from proxy_node.bodies import read_up_to

log = logging.getLogger(__name__)

MAX_SCRAPE_TIMEOUT_S = 2.0  # one scrape; a slow engine must not stall the round
MAX_METRICS_BYTES = 4 * 1024 * 1024  # an engine's /metrics larger than this is skipped
MAX_CONCURRENT_SCRAPES = 64  # engines one node scrapes at the same time

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


# The lines of the families hints come from, their HELP and TYPE lines included: the
# rest of an engine's exposition is never parsed. Parsed whole, a vLLM's (75 KB, 860
# lines with 20 histograms) held the event loop 10-15 ms per engine and scrape, and a
# line the parser refused anywhere in it lost every hint.
_HINT_LINES = re.compile(
    r"^(?:# (?:HELP|TYPE) )?(?:"
    + "|".join(re.escape(name) for name in ENGINE_METRICS)
    + r")(?=[ \t{]).*$",
    re.MULTILINE,
)


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Hints found in a Prometheus text exposition (absent metrics are simply missing)."""
    hints: dict[str, float] = {}
    relevant = "\n".join(_HINT_LINES.findall(text))
    for family in text_string_to_metric_families(relevant + "\n" if relevant else ""):
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
        raw = await read_up_to(resp.content, MAX_METRICS_BYTES + 1)
        if len(raw) > MAX_METRICS_BYTES:
            raise ValueError(f"{url} is larger than {MAX_METRICS_BYTES} bytes")
    return parse_engine_metrics(raw.decode("utf-8", "replace"))


class ScrapeShare:
    """Which alive instances are this node's to scrape, remembered between rounds.

    Rendezvous hashing costs a hash per (instance, node): 640,000 for a pool of 10,000
    instances and 64 nodes, a second of CPU. The owners are kept until the set of live
    nodes changes, and hashed in a worker thread, so that a round's event loop only
    looks them up.
    """

    def __init__(self) -> None:
        self._nodes: tuple[str, ...] = ()
        self._owners: dict[str, str] = {}

    async def mine(
        self, rows: Sequence[InstanceLoad], nodes: Sequence[str], node_id: str
    ) -> list[InstanceLoad]:
        """The alive rows whose owner among `nodes` is `node_id`."""
        key = tuple(sorted(nodes))
        alive = [row for row in rows if row.alive]
        if key != self._nodes or len(self._owners) > 2 * len(alive):  # or many removed
            self._nodes, self._owners = key, {}
        new = [row.id for row in alive if row.id not in self._owners]
        if new:  # (one scrape loop per share: no other round changes them meanwhile)
            owners = await asyncio.to_thread(lambda: [rendezvous_owner(i, key) for i in new])
            self._owners.update(zip(new, owners, strict=True))
        return [row for row in alive if self._owners[row.id] == node_id]


async def scrape_once(
    coordinator: Coordinator,
    session: aiohttp.ClientSession,
    timeout_s: float,
    share: ScrapeShare | None = None,
) -> int:
    """Scrape this node's share of the alive instances; returns how many stored hints.

    At most MAX_CONCURRENT_SCRAPES at a time: a round over thousands of engines at once
    filled the event loop with their connections (10,000: a stall of up to 1.2 s) and
    would take as many of the process's open files. A round then takes longer than
    the interval only when most engines hang to the scrape timeout.
    """
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
    mine = await (share or ScrapeShare()).mine(snap.rows, nodes, coordinator.node_id)

    async def scrape_and_store(row: InstanceLoad) -> bool:
        try:
            hints = await scrape_instance(session, row, timeout_s, coordinator.node_id)
        except Exception as exc:  # whatever an engine answers, the round goes on
            log.debug("scraping %s (%s) failed: %r", row.id, row.url, exc)
            return False
        if not hints:
            return False  # no engine metric we know
        try:
            # Hints only: a scrape proves /metrics answers, not that the engine
            # serves requests, so liveness stays with the engine's heartbeats
            # (docs/reliability.md).
            await coordinator.store_hints(row.id, hints)
        except CoordinatorError as exc:  # unregistered meanwhile, or Redis went away
            log.debug("storing hints of %s failed: %s", row.id, exc)
            return False
        return True

    queue = iter(mine)

    async def worker() -> int:
        return sum([await scrape_and_store(row) for row in queue])

    workers = min(MAX_CONCURRENT_SCRAPES, len(mine))
    return sum(await asyncio.gather(*(worker() for _ in range(workers))))


async def scrape_loop(
    coordinator: Coordinator, session: aiohttp.ClientSession, interval_s: float
) -> None:
    """Scrape every `interval_s` until cancelled; one failing round never ends the loop."""
    timeout_s = min(interval_s, MAX_SCRAPE_TIMEOUT_S)
    share = ScrapeShare()
    while True:
        try:
            await scrape_once(coordinator, session, timeout_s, share)
        except (CoordinatorError, RedisError, OSError) as exc:
            log.debug("hint scrape round failed: %s", exc)
        except Exception:
            log.exception("hint scrape round failed")
        raise_if_cancelling()  # redis-py may have swallowed our cancel (coordinator.tasks)
        await asyncio.sleep(interval_s)
