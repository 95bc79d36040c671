"""The one timing model of a continuous-batching engine, shared by the mock engine
and the simulator, so the simulator predicts what the live cluster does.

Each engine iteration is either one prefill (serialized, FCFS, time linear in the
prompt tokens not found in the prefix cache) or one decode step for every running
sequence (step time grows with batch size, one token per sequence). Prefill has
priority while the batch has room, as in vLLM's default scheduler. Time is passed in
(ms), never read from a clock.

The prefix cache (`PrefixCache`) holds whole blocks by chained hash, LRU, with a
capacity in tokens. A prefill looks its blocks up when it starts (the leading blocks
present are not recomputed, but at least one token always is, as in vLLM) and adds
them when it ends. Freed blocks of one prompt are queued tail first, so eviction takes
a prefix's tail before its head, like vLLM's free-block queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTiming:
    """Timing constants, loosely after published H100 numbers for a 7-8B model."""

    prefill_ms_per_token: float = 0.08  # ~12.5k prompt tokens/s
    prefill_overhead_ms: float = 10.0  # scheduling + kernel launch per prefill
    decode_base_ms: float = 12.0  # one decode step at batch size 1
    decode_ms_per_seq: float = 0.25  # extra step time per running sequence
    max_batch: int = 32  # running sequences at most

    def __post_init__(self) -> None:
        for name in ("prefill_ms_per_token", "prefill_overhead_ms", "decode_ms_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.decode_base_ms <= 0:
            raise ValueError("decode_base_ms must be > 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")

    def prefill_ms(self, prompt_tokens: int) -> float:
        """Time of one prefill."""
        return self.prefill_overhead_ms + self.prefill_ms_per_token * prompt_tokens

    def step_ms(self, batch: int) -> float:
        """Time of one decode step with `batch` running sequences."""
        return self.decode_base_ms + self.decode_ms_per_seq * batch

    def nominal_decode_ms_per_token(self) -> float:
        """Per-token decode time at a half-full batch: what instances register."""
        return self.step_ms(max(1, self.max_batch // 2))

    def scaled(self, speed: float) -> EngineTiming:
        """Every duration divided by `speed` (replay faster than real time)."""
        if speed <= 0:
            raise ValueError("speed must be > 0")
        return EngineTiming(
            self.prefill_ms_per_token / speed,
            self.prefill_overhead_ms / speed,
            self.decode_base_ms / speed,
            self.decode_ms_per_seq / speed,
            self.max_batch,
        )


class PrefixCache:
    """An LRU cache of prompt blocks, keyed by chained block hash, with hit counters."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, blocks: tuple[Hashable, ...], prompt_tokens: int) -> int:
        """Cached tokens of a prompt (its leading blocks present), counted and touched."""
        held = 0
        for block in blocks:
            if block not in self._blocks:
                break
            held += 1
        cached = min(held * self.block_tokens, max(0, prompt_tokens - 1))
        for block in reversed(blocks[:held]):
            self._blocks.move_to_end(block)
        self.queries += prompt_tokens
        self.hits += cached
        return cached

    def insert(self, blocks: tuple[Hashable, ...]) -> None:
        """Hold a prompt's blocks (tail first, so the head is the last to go)."""
        if self.capacity_blocks == 0:
            return
        for block in reversed(blocks):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


@dataclass(slots=True)
class Sequence:
    """One request inside the engine."""

    rid: str
    prompt_tokens: int
    output_tokens: int
    arrived_ms: float
    generated: int = 0
    first_token_ms: float | None = None
    finished_ms: float | None = None
    blocks: tuple[Hashable, ...] = ()  # chained prefix block hashes, in prompt order
    cached_tokens: int = 0  # found in the prefix cache when its prefill started


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """What happened to a sequence: `first_token`, `token` or `done`, at `at_ms`."""

    kind: str
    rid: str
    at_ms: float
    generated: int


class EngineModel:
    """A deterministic continuous-batching engine driven by explicit times."""

    def __init__(
        self, timing: EngineTiming | None = None, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.timing = timing or EngineTiming()
        self.prefix_cache = prefix_cache  # None: every prefill computes its whole prompt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._busy_until: float | None = None  # end of the iteration in progress
        self._current: Sequence | None = None  # the sequence being prefilled, if any
        self._current_cancelled = False
        self._clock = 0.0

    @property
    def num_running(self) -> int:
        """Sequences in the batch (including one being prefilled)."""
        return len(self.running) + (1 if self._current is not None else 0)

    @property
    def num_waiting(self) -> int:
        """Sequences queued FCFS, not yet prefilled."""
        return len(self.waiting)

    def submit(
        self,
        rid: str,
        prompt_tokens: int,
        output_tokens: int,
        now_ms: float,
        blocks: tuple[Hashable, ...] = (),
    ) -> None:
        """Queue a request at `now_ms`; call advance() first so time is in order.

        `blocks` are the prompt's chained prefix block hashes (for the prefix cache).
        """
        if prompt_tokens < 0 or output_tokens < 1:
            raise ValueError("prompt_tokens must be >= 0 and output_tokens >= 1")
        self.waiting.append(
            Sequence(rid, prompt_tokens, output_tokens, now_ms, blocks=tuple(blocks))
        )
        if self._busy_until is None:
            self._clock = max(self._clock, now_ms)
            self._start_iteration()

    def cancel(self, rid: str) -> bool:
        """Drop a sequence (client went away); True if it was inside."""
        if self._current is not None and self._current.rid == rid:
            self._current_cancelled = True  # the prefill in progress still takes its time
            return True
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.rid == rid:
                    queue.remove(seq)
                    return True
        return False

    def next_event_ms(self) -> float | None:
        """When the iteration in progress ends, or None when idle."""
        return self._busy_until

    def advance(self, now_ms: float) -> list[EngineEvent]:
        """Complete every iteration that ends at or before `now_ms`."""
        events: list[EngineEvent] = []
        while self._busy_until is not None and self._busy_until <= now_ms:
            self._clock = self._busy_until
            self._finish_iteration(events)
            self._start_iteration()
        return events

    def remaining_work_ms(self, now_ms: float | None = None) -> float:
        """Exact time from `now_ms` (default: the last iteration boundary) to drain
        everything inside, assuming no new arrivals (the oracle's knowledge). Queued
        prefills are counted whole: the prefix cache is not looked ahead into."""
        probe = EngineModel(self.timing)
        probe.waiting = deque(
            Sequence(s.rid, s.prompt_tokens, s.output_tokens, s.arrived_ms, s.generated)
            for s in self.waiting
        )
        probe.running = [
            Sequence(s.rid, s.prompt_tokens, s.output_tokens, s.arrived_ms, s.generated)
            for s in self.running
        ]
        probe._clock = self._clock
        probe._busy_until = self._busy_until
        if self._current is not None:
            c = self._current
            probe._current = Sequence(c.rid, c.prompt_tokens, c.output_tokens, c.arrived_ms)
            probe._current_cancelled = self._current_cancelled
        elif self._busy_until is None and (probe.waiting or probe.running):
            probe._start_iteration()
        end = self._clock
        while probe._busy_until is not None:
            end = probe._busy_until
            probe.advance(end)
        start = self._clock if now_ms is None else max(now_ms, self._clock)
        return max(0.0, end - start)

    def _start_iteration(self) -> None:
        t = self.timing
        if self.waiting and len(self.running) < t.max_batch:
            seq = self._current = self.waiting.popleft()
            if self.prefix_cache is not None:
                seq.cached_tokens = self.prefix_cache.lookup(seq.blocks, seq.prompt_tokens)
            self._busy_until = self._clock + t.prefill_ms(seq.prompt_tokens - seq.cached_tokens)
        elif self.running:
            self._current = None
            self._busy_until = self._clock + t.step_ms(len(self.running))
        else:
            self._current = None
            self._busy_until = None

    def _finish_iteration(self, events: list[EngineEvent]) -> None:
        now = self._clock
        if self._current is not None:
            seq, self._current = self._current, None
            if self.prefix_cache is not None:
                self.prefix_cache.insert(seq.blocks)  # computed, even if now cancelled
            if self._current_cancelled:
                self._current_cancelled = False
                return
            seq.generated = 1
            seq.first_token_ms = now
            events.append(EngineEvent("first_token", seq.rid, now, 1))
            if seq.generated >= seq.output_tokens:
                seq.finished_ms = now
                events.append(EngineEvent("done", seq.rid, now, seq.generated))
            else:
                self.running.append(seq)
            return
        still: list[Sequence] = []
        for seq in self.running:
            seq.generated += 1
            events.append(EngineEvent("token", seq.rid, now, seq.generated))
            if seq.generated >= seq.output_tokens:
                seq.finished_ms = now
                events.append(EngineEvent("done", seq.rid, now, seq.generated))
            else:
                still.append(seq)
        self.running = still
