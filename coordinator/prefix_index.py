"""The fleet-shared, approximate prefix index of one pool (coordinator/prefix_entries.py
says its format in Redis and what it means).

Each Redis round trip costs the server more than the commands in it (a PING took
30-40 µs of its CPU on the 2-core machine of docs/benchmarks.md), and a Lua script
pays for every string that crosses into it and back. So per request, in the steady
state, the index costs one round trip of small work and a little more work in a call
the node makes anyway, whatever the pool's size:

- at decision time, one HMGET of the prompt's blocks (at most `prefix_max_blocks`
  fields). Validity needs the counts of the instances named: the node takes those it
  read or wrote lately as they were (`SeenCounts`: for as long as a count takes to
  move 1/32 of the capacity on at the rate it grew, 0.1-10 s), and reads the
  others in one more HMGET. The
  epochs and capacities come from the node's own snapshot cache.
- after the choice (off the request's path), one record (an HMGET of the instance's
  count and the blocks it records, and an HSET, in Lua: lua/_lib.lua record_prefix):
  an entry every `prefix_record_stride` blocks and at the prompt's last block only
  (see `recorded_entries`), a few fields per request. It rides along with the node's
  next `reserve`, or a `carry` call after `carry_ms` (coordinator/held_records.py):
  no round trip of its own.
- one record in `SAMPLE_EVERY` also reclaims the invalid entries among the next
  fields of the node's sweep through the index (`HSCAN` on from where its previous
  sample ended; plain commands, three round trips: see `_reclaim`).

Lookup and record degrade to "nothing cached" / "nothing recorded" while Redis is
unreachable or refuses writes: affinity is an optimization, never a reason to fail a
request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

from redis.exceptions import RedisError

from coordinator.errors import CoordinationUnavailableError
from coordinator.keys import PoolKeys
from coordinator.prefix import (
    CachedTokens,
    HotPrefixes,
    PromptBlocks,
    RecentStarts,
    block_hashes,
    block_tokens,
    canonical_prompt,
    hot_instances,
    salt_key,
)
from coordinator.prefix_entries import (
    ABOUT,
    SeenCounts,
    cached_blocks,
    current_stems,
    owner_of,
    parse_entries,
    reclaimed,
    sampled_names,
    stem,
)
from coordinator.settings import Settings

SAMPLE_EVERY = 16  # one record in this many also reclaims invalid entries
# Fields such a record samples per entry it writes: twice what the node's records add
# between samples, so at most about half of the index is invalid at any time (each
# sample reclaims the invalid share of what it reads).
SAMPLE_PER_ENTRY = 2 * SAMPLE_EVERY
MAX_SAMPLE = 1024  # fields one record samples, at most
# Holds a record (stem, max_owners, flat block hash and weight pairs) for the node's
# next call: Coordinator.hold_record.
HoldRecord = Callable[[str, int, Sequence[Any]], Awaitable[int]]
# What a failed index read or write can raise: affinity then waits for Redis. A value
# that is not UTF-8 (no node writes one) fails the client's decoding: the request goes
# without credit, and its record rewrites the value (record_prefix keeps only entries).
FAILURES = (RedisError, OSError, TimeoutError, UnicodeDecodeError)


class PrefixIndex:
    """Hashing, lookup and recording of prompt prefix blocks for one pool."""

    def __init__(
        self,
        redis: Any,
        keys: PoolKeys,
        settings: Settings,
        hold_record: HoldRecord,
        epoch_of: Callable[[str], int | None],
        capacity_tokens: Callable[[str], int | None],
        degraded: Callable[[], bool],
        redis_now_ms: Callable[[], float],
    ) -> None:
        self._redis = redis
        self._settings = settings
        self._hold_record = hold_record
        self._epoch_of = epoch_of
        self._capacity_tokens = capacity_tokens
        self._degraded = degraded
        self._redis_now_ms = redis_now_ms  # the node's estimate of the Redis clock
        self._key = salt_key(keys.pool, settings.prefix_salt)
        self._index = keys.prefix_index()
        self._epochs = keys.column("epoch")
        self._legacy = keys.legacy_prefix_keys()
        self.block_tokens = block_tokens(settings.prefix_block_chars)
        # Expected cached tokens per instance of the last request this node looked up
        # (numbers only), for /debug/instance_loads and the dashboard.
        self.last_lookup: dict[str, int] = {}
        self._records = 0
        self._cursor = 0  # where the node's next reclaim sample goes on (HSCAN)
        self.seen = SeenCounts()  # the counts this node read or wrote lately
        # The prefixes this node routed moments ago: only those are hot-spot guarded;
        # and the requests the fleet sent each instance lately, the bounded-loads
        # rule's counts (coordinator/prefix.py).
        self.hot = HotPrefixes(settings.prefix_hot_ms)
        self.starts = RecentStarts(settings.prefix_hot_ms)

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

    def capacity_blocks(self, instance_id: str) -> int:
        """Blocks an instance's cache holds: its spec's prefix_cache_tokens, else the
        node's default."""
        tokens = self._capacity_tokens(instance_id)
        if tokens is None:
            tokens = self._settings.prefix_cache_tokens
        return tokens // self.block_tokens

    async def cached_tokens(self, hashes: Sequence[str]) -> dict[str, int]:
        """Expected cached prompt tokens per instance (instances with none are absent).

        A `CachedTokens`: its `hot` names the instances whose credited prefix this
        node routed within `prefix_hot_ms` (none when 0), which the hot-spot guard
        fades over `prefix_hot_guard_ms` (coordinator/prefix.py).
        """
        if not hashes or self._degraded():
            return {}  # degraded: no Redis round trip (and no timeout) per request
        try:
            values = _texts(await self._redis.hmget(self._index, list(hashes)))
            entries = [parse_entries(v) for v in values]
            counts = await self._known_counts(current_stems(entries, self._epoch_of))
        except FAILURES:
            return {}  # the reserve that follows notices an outage and degrades
        held = cached_blocks(entries, counts, self._epoch_of, self.capacity_blocks)
        tokens = {iid: blocks * self.block_tokens for iid, blocks in held.items()}
        self.last_lookup = tokens
        hot, popular = hot_instances(
            held, hashes, self.hot, time.monotonic() * 1000, self._redis_now_ms()
        )
        return CachedTokens(tokens, hot, popular)

    async def _known_counts(self, stems: Sequence[str]) -> dict[str, int | None]:
        """The counts of these stems as a lookup takes them: those this node saw
        lately (`SeenCounts`), the others read (one HMGET)."""
        now = time.monotonic() * 1000
        out: dict[str, int | None] = {}
        missing = []
        for s in stems:
            count = self.seen.fresh(s, self.capacity_blocks(owner_of(s)), now)
            if count is None:
                missing.append(s)
            else:
                out[s] = count
        for s, read in (await self._counts(missing)).items():
            out[s] = read
            if read is not None:
                self.seen.note(s, read, now)
        return out

    async def _counts(self, stems: Sequence[str]) -> dict[str, int | None]:
        if not stems:
            return {}
        values = _texts(await self._redis.hmget(self._index, list(stems)))
        return {s: _count(v) for s, v in zip(stems, values, strict=True)}

    async def index_tokens(self, instances: Sequence[tuple[str, int]]) -> dict[str, int]:
        """Tokens the index holds per (instance id, epoch): one HMGET of their counts.

        For debug views and `coordinator inspect`, never on the request path.
        """
        counts = await self._counts([stem(iid, epoch) for iid, epoch in instances])
        return {
            iid: min(counts[stem(iid, epoch)] or 0, self.capacity_blocks(iid)) * self.block_tokens
            for iid, epoch in instances
        }

    def routed(self, hashes: Sequence[str]) -> None:
        """Note at once (before the next decision) that this node routed a request with
        these blocks: what makes a prefix hot (coordinator/prefix.py)."""
        now_ms = time.monotonic() * 1000
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
        epoch = self._epoch_of(instance_id)
        if not hashes or epoch is None or self.capacity_blocks(instance_id) <= 0:
            return
        held = held_tokens // self.block_tokens
        entries = recorded_entries(len(hashes), held, self._settings.prefix_record_stride)
        head = stem(instance_id, epoch)
        pairs: list[Any] = []
        for position, weight in entries:
            pairs += [hashes[position - 1], weight]
        self._records += 1
        try:
            count = await self._hold_record(head, self._settings.prefix_max_owners, pairs)
        except Exception:  # the call that carried it reports its own failure
            return  # not known to be recorded: the index is approximate anyway
        self.seen.note(head, count, time.monotonic() * 1000)
        if self._records % SAMPLE_EVERY == 1:
            with suppress(CoordinationUnavailableError, *FAILURES):  # reclaimed later
                await self._reclaim(min(MAX_SAMPLE, SAMPLE_PER_ENTRY * len(entries)))

    async def _reclaim(self, sample: int) -> None:
        """Reclaim the invalid entries among about `sample` fields of the index, and
        unlink what earlier versions kept. Three round trips: the sample, the epochs
        and counts it names, the writes. A record written meanwhile into a rewritten
        field can be lost (a missed credit).

        The sample is the next stretch of the node's sweep (`HSCAN` from where its
        previous sample ended, from the start once a sweep is through): each sweep
        reads every field, where random samples (`HRANDFIELD`) leave some unread for
        many samples. It also costs the server less: about the same instructions
        (bench/instructions.py's index rows moved 2-3%: a sample's cost is mostly its
        reply), but it reads the hash's buckets in order where random draws miss the
        CPU's caches (on a 60,000-field hash, a 128-field sample took 144-163 µs of
        server CPU against 243-284 µs). A small index comes whole."""
        cursor, found = await self._redis.hscan(self._index, self._cursor, count=sample)
        self._cursor = int(cursor)
        sampled = [(_text(k), _text(v)) for k, v in found.items()]
        owners, stems = sampled_names(sampled)
        epochs: dict[str, int | None] = {}
        counts: dict[str, int | None] = {}
        if owners:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hmget(self._epochs, owners)
            if stems:
                pipe.hmget(self._index, stems)
            got = [_texts(values) for values in await pipe.execute()]
            epochs = {o: _count(v) for o, v in zip(owners, got[0], strict=True)}
            if stems:
                counts = {s: _count(v) for s, v in zip(stems, got[1], strict=True)}
        dels, sets = reclaimed(sampled, epochs, counts, self.capacity_blocks)
        pipe = self._redis.pipeline(transaction=False)
        if dels:
            pipe.hdel(self._index, *dels)
        if sets:
            pipe.hset(self._index, mapping=sets)
        pipe.hsetnx(self._index, "#about", ABOUT)
        pipe.unlink(*self._legacy)
        await pipe.execute()


def _count(value: str | None) -> int | None:
    """A count or epoch as stored (None: absent, or not a number a node wrote)."""
    return int(value) if value is not None and value.isdigit() else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _texts(values: Sequence[str | bytes | None]) -> list[str | None]:
    return [None if v is None else _text(v) for v in values]


def recorded_entries(blocks: int, held: int, stride: int) -> list[tuple[int, int]]:
    """The (position, weight) entries a record of a `blocks`-block prompt writes, whose
    first `held` blocks the instance holds (positions from 1).

    The deepest held block is refreshed (weight 0: it adds no block); of the blocks
    after it, every `stride`-th position and the last get an entry, weighted with the
    blocks since the previous entry. A block's hash covers its whole prefix, so an
    entry stands for all the blocks before it: a lookup credits the deepest entry an
    instance holds, at most `stride - 1` blocks short of what it holds (none short of
    a whole recorded prompt, as a conversation's next turn asks), and the instance's
    count adds the weights, i.e. blocks.
    """
    held = min(max(held, 0), blocks)
    out = [(held, 0)] if held else []
    previous = held
    for position in range(held + 1, blocks + 1):
        if position % stride == 0 or position == blocks:
            out.append((position, position - previous))
            previous = position
    return out
