"""Prefix-aware routing in the simulator: the node's shared index, and baselines.

`SharedPrefixIndex` is the node's index (lua/_lib.lua record_prefix, coordinator/prefix.py)
in memory: per instance an LRU of block ids bounded by the instance's capacity (a
prompt's blocks queued tail first), each block remembering its `max_owners` most
recent instances; a node refreshes the deepest block the instance held and adds an
entry every `stride` blocks after it and at the last one, each weighing the blocks
since the previous entry (the capacity counts weights), and a lookup credits each
instance with the deepest block it holds (noting where that entry is one a recorded
prompt went on past, as lua/_lib.lua record_prefix marks it with '+').
tests/benchmarks/test_sim_prefix.py checks it against the real index on a server.

Baselines (each one node's choice from the same shared information):

- `consistent_hash`: the first block's id on a hash ring of the instances (64
  virtual points each); pure affinity, blind to load.
- `sglang_cache_aware`: the SGLang router's cache-aware policy. When the load
  (inflight requests) is imbalanced, `max - min > abs_threshold` and
  `max > rel_threshold * min`, the least loaded instance; otherwise the instance
  with the longest prefix match if its match ratio (matched / prompt tokens) is
  above `cache_threshold`, else the instance whose index holds the fewest blocks.
  Defaults are the sgl-router's (cache 0.5, abs 32, rel 1.1).
- `dynamo_kv`: NVIDIA Dynamo's KV router cost, lowest wins:
  `overlap_weight * (queued prefill tokens + uncached tokens of the request) / block
  + active KV blocks` (tokens of live requests / block); weight 1 is Dynamo's default.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from coordinator.prefix_entries import HeldBlocks
from coordinator.prefix_index import recorded_entries


class SharedPrefixIndex:
    """The fleet's approximate prefix index (lua/_lib.lua record_prefix), in memory."""

    def __init__(self, capacity_blocks: int, max_owners: int = 8, stride: int = 1) -> None:
        self.capacity_blocks = capacity_blocks
        self.max_owners = max_owners
        self.stride = stride
        self._count: dict[str, int] = {}  # blocks each instance's engine processed
        # block -> (instance, position, second a prompt went on past it or None)
        # entries, most recent last
        self._owners: dict[Hashable, list[tuple[str, int, int | None]]] = {}

    def size(self, instance: str) -> int:
        """Blocks the index holds for an instance (at most its capacity)."""
        return min(self._count.get(instance, 0), self.capacity_blocks)

    def _valid(self, instance: str, position: int) -> bool:
        return self._count[instance] - position < self.capacity_blocks

    def record(
        self, instance: str, blocks: Sequence[Hashable], held: int = 0, now_ms: float = 0.0
    ) -> None:
        """The chosen instance processed these blocks; `held` leading blocks of them it
        held already (only the deepest of those gets an entry again), and of the others
        only every `stride`-th and the last get an entry. Each entry advances the
        instance's count by the blocks it stands for, deepest first."""
        if self.capacity_blocks <= 0 or not blocks:
            return
        count = self._count.get(instance, 0)
        for position, weight in reversed(recorded_entries(len(blocks), held, self.stride)):
            count += weight
            owners = [o for o in self._owners.get(blocks[position - 1], ()) if o[0] != instance]
            del owners[: max(0, len(owners) - self.max_owners + 1)]  # room for this entry
            inside = int(now_ms // 1000) if position < len(blocks) else None
            owners.append((instance, count, inside))
            self._owners[blocks[position - 1]] = owners
        self._count[instance] = count

    def cached_blocks(self, blocks: Sequence[Hashable], max_blocks: int = 1 << 30) -> HeldBlocks:
        """Blocks each instance holds: its deepest valid entry (instances with none
        absent), and those credited inside a recorded prompt (`HeldBlocks.continued`)."""
        held: dict[str, int] = {}
        continued: dict[str, int] = {}
        looked = blocks[:max_blocks]
        for position in range(len(looked) - 1, -1, -1):
            for owner, at, inside in self._owners.get(looked[position], ()):
                if owner not in held and self._valid(owner, at):
                    held[owner] = position + 1
                    if inside is not None:
                        continued[owner] = inside
        return HeldBlocks(held, continued)


class HashRing:
    """Consistent hashing of block ids onto instances (64 virtual points each)."""

    def __init__(self, ids: Sequence[str], points: int = 64) -> None:
        ring = sorted(
            (zlib.crc32(f"{iid}#{p}".encode()), iid) for iid in ids for p in range(points)
        )
        self._keys = [k for k, _ in ring]
        self._ids = [iid for _, iid in ring]

    def owner(self, key: Hashable) -> str:
        """The instance a key maps to."""
        h = zlib.crc32(repr(key).encode())
        return self._ids[bisect.bisect(self._keys, h) % len(self._ids)]


@dataclass(frozen=True, slots=True)
class SglangThresholds:
    """The SGLang router's cache-aware knobs (sgl-router defaults)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1


def sglang_choice(
    ids: Sequence[str],
    loads: Sequence[int],
    matched_tokens: dict[str, int],
    prompt_tokens: int,
    index_sizes: Sequence[int],
    t: SglangThresholds,
) -> int:
    """The SGLang cache-aware choice (module docstring), as an index into `ids`."""
    high, low = max(loads), min(loads)
    if high - low > t.balance_abs_threshold and high > t.balance_rel_threshold * low:
        return loads.index(low)
    best = max(range(len(ids)), key=lambda k: (matched_tokens.get(ids[k], 0), -loads[k]))
    ratio = matched_tokens.get(ids[best], 0) / max(1, prompt_tokens)
    if ratio > t.cache_threshold:
        return best
    return min(range(len(ids)), key=lambda k: (index_sizes[k], loads[k]))


def dynamo_choice(
    queued_prefill_tokens: Sequence[int],
    uncached_tokens: Sequence[int],
    active_tokens: Sequence[int],
    block_tokens: int,
    overlap_weight: float = 1.0,
) -> int:
    """Dynamo's KV router choice (module docstring), as an index; first on ties."""
    costs = [
        overlap_weight * (queued + new) / block_tokens + active / block_tokens
        for queued, new, active in zip(
            queued_prefill_tokens, uncached_tokens, active_tokens, strict=True
        )
    ]
    return costs.index(min(costs))
