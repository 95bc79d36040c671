"""The fleet-shared, approximate prefix index of one pool (lua/record_prefix.lua).

At decision time a node asks how many leading blocks of the prompt each instance
holds: one HMGET of at most `prefix_max_blocks` fields, whatever the pool size, and
the epochs come from the node's own snapshot cache. After the choice, it records the
prompt's blocks against the chosen instance: one bounded script call, with an entry
every `prefix_record_stride` blocks and at the prompt's last block only (see
`recorded_entries`), which keeps its Redis work to a few entries per request. Both degrade
to "nothing cached" / "nothing recorded" while Redis is unreachable: affinity is an
optimization, never a reason to fail a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.errors import CoordinationUnavailableError
from coordinator.keys import PoolKeys
from coordinator.prefix import (
    CachedTokens,
    HotPrefixes,
    PromptBlocks,
    RecentCounts,
    block_hashes,
    block_tokens,
    cached_blocks,
    canonical_prompt,
    hot_instances,
    salt_key,
)
from coordinator.settings import Settings

SAMPLE_EVERY = 8  # one record call in this many also reclaims void entries (a sample)
CallScript = Callable[[str, list[Any], tuple[str | bytes, ...]], Any]


class PrefixIndex:
    """Hashing, lookup and recording of prompt prefix blocks for one pool."""

    def __init__(
        self,
        redis: Any,
        keys: PoolKeys,
        settings: Settings,
        call: CallScript,
        epoch_of: Callable[[str], int | None],
        capacity_tokens: Callable[[str], int | None],
        unavailable: tuple[type[BaseException], ...],
        degraded: Callable[[], bool],
    ) -> None:
        self._redis = redis
        self._settings = settings
        self._call = call
        self._epoch_of = epoch_of
        self._capacity_tokens = capacity_tokens
        self._unavailable = unavailable
        self._degraded = degraded
        self._key = salt_key(keys.pool, settings.prefix_salt)
        self._owners = keys.prefix_owners()
        self._lru = keys.prefix_lru()
        self.block_tokens = block_tokens(settings.prefix_block_chars)
        # Expected cached tokens per instance of the last request this node looked up
        # (numbers only), for /debug/instance_loads and the dashboard.
        self.last_lookup: dict[str, int] = {}
        self._records = 0
        # The prefixes this node routed moments ago: only those are hot-spot guarded,
        # and the instances it routed to then (the bounded-loads rule's counts).
        self.hot = HotPrefixes(settings.prefix_hot_ms)
        self.routes = RecentCounts(settings.prefix_hot_ms)

    @property
    def enabled(self) -> bool:
        """Whether the node routes by prefix (Settings.prefix_affinity)."""
        return self._settings.prefix_affinity

    def hashes(self, body: dict[str, Any]) -> list[str]:
        """The salted block hashes of a request body (none when affinity is off)."""
        if not self.enabled:
            return []
        s = self._settings
        return block_hashes(
            canonical_prompt(body), self._key, s.prefix_block_chars, s.prefix_max_blocks
        )

    async def cached_tokens(self, hashes: Sequence[str]) -> dict[str, int]:
        """Expected cached prompt tokens per instance (instances with none are absent).

        A `CachedTokens`: its `hot` names the instances whose credited prefix this
        node routed within `prefix_hot_ms` (none when 0), which the hot-spot guard
        fades over `prefix_hot_guard_ms` (coordinator/prefix.py).
        """
        if not hashes or self._degraded():
            return {}  # degraded: no Redis round trip (and no timeout) per request
        try:
            values = await self._redis.hmget(self._owners, list(hashes))
        except self._unavailable:
            return {}  # the reserve that follows notices the outage and degrades
        owners = [None if v is None else v.decode() if isinstance(v, bytes) else v for v in values]
        held = cached_blocks(owners, self._epoch_of)
        tokens = {iid: blocks * self.block_tokens for iid, blocks in held.items()}
        self.last_lookup = tokens
        hot, popular = hot_instances(held, hashes, self.hot, time.monotonic() * 1000)
        return CachedTokens(tokens, hot, popular)

    async def index_tokens(self, instances: Sequence[tuple[str, int]]) -> dict[str, int]:
        """Tokens the index holds per (instance id, epoch): one HMGET of their counts.

        For debug views and `coordinator inspect`, never on the request path.
        """
        if not instances:
            return {}
        fields = [f"{iid}#{epoch:010d}" for iid, epoch in instances]
        counts = await self._redis.hmget(self._owners, fields)
        return {
            iid: int(n or 0) * self.block_tokens
            for (iid, _), n in zip(instances, counts, strict=True)
        }

    def routed(self, instance_id: str, hashes: Sequence[str]) -> None:
        """Note at once (before the next decision) that this node routed a request with
        these blocks to `instance_id`: what makes a prefix hot, and the counts of the
        hot-spot guard's bounded loads (coordinator/prefix.py)."""
        now_ms = time.monotonic() * 1000
        self.routes.note((instance_id,), now_ms)
        tail = hashes.after(len(hashes)) if isinstance(hashes, PromptBlocks) else None
        self.hot.note(hashes, now_ms, tail)

    async def record(self, instance_id: str, hashes: Sequence[str], held_tokens: int = 0) -> None:
        """Record that `instance_id` now holds these blocks (best effort).

        `held_tokens` is what the lookup found the instance holding already: only the
        deepest block it held (refreshed) and the new ones after it are sent, so a
        conversation's next turn costs the blocks it adds, not its whole history. A
        whole hit still refreshes its deepest block: the engine's cache keeps a prompt
        in constant use, so the index must not evict it as the oldest. Of the new
        blocks, only every `prefix_record_stride`-th and the last get an entry.
        """
        if not hashes:
            return
        held = held_tokens // self.block_tokens
        entries = recorded_entries(len(hashes), held, self._settings.prefix_record_stride)
        capacity = self._capacity_tokens(instance_id)
        if capacity is None:
            capacity = self._settings.prefix_cache_tokens
        self._records += 1
        sample = int(self._records % SAMPLE_EVERY == 1)
        args = [
            instance_id,
            capacity // self.block_tokens,
            self._settings.prefix_max_owners,
            sample,
        ]
        for position, weight in entries:
            args += [hashes[position - 1], weight]
        try:
            await self._call("record_prefix", args, (self._owners, self._lru))
        except CoordinationUnavailableError:
            pass  # degraded: nothing to record into; the index is approximate anyway


def recorded_entries(blocks: int, held: int, stride: int) -> list[tuple[int, int]]:
    """The (position, weight) entries a record of a `blocks`-block prompt writes, whose
    first `held` blocks the instance holds (positions from 1).

    The deepest held block is refreshed (weight 0: it keeps its own); of the blocks
    after it, every `stride`-th position and the last get an entry, weighted with the
    blocks since the previous entry. A block's hash covers its whole prefix, so an
    entry stands for all the blocks before it: a lookup credits the deepest entry an
    instance holds, at most `stride - 1` blocks short of what it holds (none short of
    a whole recorded prompt, as a conversation's next turn asks), and the capacity
    counts the weights, i.e. blocks.
    """
    held = min(max(held, 0), blocks)
    out = [(held, 0)] if held else []
    previous = held
    for position in range(held + 1, blocks + 1):
        if position % stride == 0 or position == blocks:
            out.append((position, position - previous))
            previous = position
    return out
