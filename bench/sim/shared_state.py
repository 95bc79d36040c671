"""An in-memory pool with the semantics of the Lua scripts, for the simulator.

It mirrors coordinator/lua/{_lib,register,heartbeat,reserve,mark_first_token,
release}.lua operation by operation, so `coordinator.pressure.instance_load` and
`coordinator.strategies` run unchanged on the `InstanceRow`s it produces. Times are
integer ms passed in by the caller (the simulated Redis clock). Left out, because
the simulator never exercises them: TTLs and leases, epoch bumps (every record's
epoch matches) and max_slots enforcement. The candidate load guard of reserve is
`SharedState.within`; the simulator runs the candidate loop with it.

`NodeView` is what one node holds of the state between reads (coordinator/snapshot.py's
PoolCache): the rows of its last read, with the records its own scripts' replies
rewrote since, and the hints of its last liveness read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from coordinator.models import HINT_NAMES, Hint, InstanceRow, InstanceSpec
from coordinator.timing import TimingSource


@dataclass(slots=True)
class SimReservation:
    """A reservation record, the fields of reserve.lua's JSON."""

    rid: str
    instance: str
    epoch: int
    node: str
    phase: str
    prompt_tokens: int
    expected_output_tokens: int
    prefill_ms: int
    decode_ms: int
    created_ms: int
    first_token_at_ms: int
    end_at_ms: int
    predicted_ttft_ms: int


@dataclass(slots=True)
class _Instance:
    spec: InstanceSpec
    epoch: int
    last_seen_ms: int
    max_slots: int
    inflight: int = 0
    pending_prefill: int = 0
    active_decode: int = 0
    pending_prefill_ms: int = 0
    prefill_free_at_ms: int = 0
    started: int = 0  # reservations ever placed (packed.py `started`, no wrap here)
    hints: dict[str, Hint] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)  # rid -> end_at_ms (by_instance)
    row: InstanceRow | None = None  # cached; dropped on every change
    timing: TimingSource | None = None  # set with a resolved spec (PoolCache does the same)


class SharedState:
    """One pool's reservations and counters, as Redis holds them."""

    def __init__(self) -> None:
        self._instances: dict[str, _Instance] = {}
        self._reservations: dict[str, SimReservation] = {}

    def _touch(self, inst: _Instance) -> None:
        inst.row = None  # the packed record changed: rebuild the row

    def register(self, spec: InstanceSpec, now_ms: int) -> int:
        """register.lua for a new instance (or an update at the same epoch); the epoch."""
        inst = self._instances.get(spec.id)
        if inst is None:
            inst = _Instance(spec, spec.epoch or 1, now_ms, spec.max_slots)
            inst.prefill_free_at_ms = now_ms
            self._instances[spec.id] = inst
        else:
            inst.spec = spec
            inst.max_slots = spec.max_slots
            inst.last_seen_ms = now_ms
        self._touch(inst)
        return inst.epoch

    def set_timing(self, instance_id: str, spec: InstanceSpec, source: TimingSource) -> None:
        """Give an instance's row resolved timing, as a node's PoolCache does."""
        inst = self._instances[instance_id]
        inst.spec, inst.timing = spec, source
        self._touch(inst)

    def heartbeat(
        self, instance_id: str, now_ms: int, hints: dict[str, float] | None = None
    ) -> None:
        """heartbeat.lua: refresh liveness and store the hints given (others keep theirs)."""
        inst = self._instances[instance_id]
        inst.last_seen_ms = now_ms
        for name, value in (hints or {}).items():
            if name not in HINT_NAMES:
                raise ValueError(f"unknown hint {name!r}")
            inst.hints[name] = Hint(float(value), now_ms)
        self._touch(inst)

    def reserve(
        self,
        rid: str,
        node: str,
        instance_id: str,
        prompt_tokens: int,
        expected_output_tokens: int,
        prefill_ms: int,
        decode_ms: int,
        now_ms: int,
    ) -> tuple[str, SimReservation]:
        """reserve.lua on one candidate: ('ok'|'dup', the record)."""
        existing = self._reservations.get(rid)
        if existing is not None:
            return "dup", existing
        inst = self._instances[instance_id]
        start = max(now_ms, inst.prefill_free_at_ms)
        first_token_at = start + prefill_ms
        end_at = first_token_at + decode_ms
        inst.prefill_free_at_ms = first_token_at
        inst.inflight += 1
        inst.pending_prefill += 1
        inst.pending_prefill_ms += prefill_ms
        inst.started += 1
        rec = SimReservation(
            rid,
            instance_id,
            inst.epoch,
            node,
            "prefill",
            prompt_tokens,
            expected_output_tokens,
            prefill_ms,
            decode_ms,
            now_ms,
            first_token_at,
            end_at,
            first_token_at - now_ms,
        )
        self._reservations[rid] = rec
        inst.ends[rid] = end_at
        self._touch(inst)
        return "ok", rec

    def mark_first_token(self, rid: str, now_ms: int) -> bool:
        """mark_first_token.lua: prefill -> decode; False (noop) when unknown or done."""
        rec = self._reservations.get(rid)
        if rec is None or rec.phase != "prefill":
            return False
        inst = self._instances[rec.instance]
        rec.phase = "decode"
        rec.first_token_at_ms = now_ms
        rec.end_at_ms = now_ms + rec.decode_ms
        inst.ends[rid] = rec.end_at_ms
        if inst.pending_prefill > 0:
            inst.pending_prefill -= 1
        inst.active_decode += 1
        inst.pending_prefill_ms -= rec.prefill_ms
        self._rechain_after_first_token(inst, now_ms)
        self._touch(inst)
        return True

    def release(self, rid: str, now_ms: int) -> bool:
        """release.lua: drop the reservation and its counters; False (noop) when unknown."""
        rec = self._reservations.pop(rid, None)
        if rec is None:
            return False
        inst = self._instances[rec.instance]
        del inst.ends[rid]
        if inst.inflight > 0:
            inst.inflight -= 1
        if rec.phase == "prefill":
            if inst.pending_prefill > 0:
                inst.pending_prefill -= 1
            inst.pending_prefill_ms -= rec.prefill_ms
            self._rechain_after_cancel(inst, rec, now_ms)
        elif inst.active_decode > 0:
            inst.active_decode -= 1
        self._touch(inst)
        return True

    @staticmethod
    def _rechain_after_first_token(inst: _Instance, now_ms: int) -> None:
        # _lib.lua rechain_after_first_token: the queue behind starts now.
        inst.pending_prefill_ms = max(0, inst.pending_prefill_ms)
        inst.prefill_free_at_ms = now_ms + inst.pending_prefill_ms

    @staticmethod
    def _rechain_after_cancel(inst: _Instance, rec: SimReservation, now_ms: int) -> None:
        # _lib.lua rechain_after_cancel: an unstarted prefill takes only its share out;
        # a started one is finished by the engine anyway.
        inst.pending_prefill_ms = max(0, inst.pending_prefill_ms)
        cursor = inst.prefill_free_at_ms
        if rec.first_token_at_ms - rec.prefill_ms > now_ms:
            inst.prefill_free_at_ms = max(now_ms, cursor - rec.prefill_ms)
        else:
            inst.prefill_free_at_ms = max(cursor, now_ms + inst.pending_prefill_ms)

    def reservation(self, rid: str) -> SimReservation | None:
        """The live record of `rid`, if any."""
        return self._reservations.get(rid)

    def pending_prefill_ms(self, instance_id: str) -> int:
        """The pending_prefill_ms column of one instance."""
        return self._instances[instance_id].pending_prefill_ms

    def row(self, instance_id: str) -> InstanceRow:
        """The instance's row exactly as a snapshot delta would carry it."""
        inst = self._instances[instance_id]
        if inst.row is None:
            inst.row = InstanceRow(
                id=instance_id,
                spec=inst.spec,
                epoch=inst.epoch,
                last_seen_ms=inst.last_seen_ms,
                max_slots=inst.max_slots,
                inflight=inst.inflight,
                pending_prefill=inst.pending_prefill,
                active_decode=inst.active_decode,
                prefill_free_at_ms=inst.prefill_free_at_ms,
                earliest_end_at_ms=min(inst.ends.values()) if inst.ends else None,
                hints=dict(inst.hints),
                timing=inst.timing,
                started=inst.started,
            )
        return inst.row

    def rows(self) -> list[InstanceRow]:
        """Every instance's row, in registration order."""
        return [self.row(iid) for iid in self._instances]

    def within(self, instance_id: str, max_inflight: int, max_pending: int) -> bool:
        """reserve.lua's check of an unforced candidate's count bounds (guard.py)."""
        inst = self._instances[instance_id]
        return inst.inflight <= max_inflight and inst.pending_prefill <= max_pending

    def walk(
        self,
        candidates: Sequence[tuple[str, int, int, int, int]],
        now_ms: int,
    ) -> int | None:
        """reserve.lua's unforced choice among `candidates` in the order it visits them,
        each (id, prefill_ms, max inflight, max pending_prefill, max prefill_free_at):
        of those within their count bounds and not beaten by one visited before them
        that was not (fewer live reservations and a TTFT no longer), up to the first
        within all its bounds (all of them when none is), the position of the one
        whose prefill starts soonest, first on ties; with none such, the least busy
        when it has no more live reservations than the pool's mean; None ('stale')
        else."""
        timed: tuple[int, int] | None = None  # (prefill start + own prefill, position)
        least: int | None = None
        overs: list[tuple[int, int]] = []  # (inflight, TTFT) of those over their counts
        for i, (iid, prefill_ms, max_inflight, max_pending, max_free_at) in enumerate(candidates):
            inst = self._instances[iid]
            if least is None or inst.inflight < self.inflight(candidates[least][0]):
                least = i
            free_at = inst.prefill_free_at_ms
            ttft = max(now_ms, free_at) + prefill_ms
            if not self.within(iid, max_inflight, max_pending):
                overs.append((inst.inflight, ttft))
                continue
            if any(n < inst.inflight and t <= ttft for n, t in overs):
                continue
            if timed is None or ttft < timed[0]:
                timed = (ttft, i)
            if max_free_at == 0 or free_at <= max(now_ms, max_free_at):
                break
        if timed is not None:
            return timed[1]
        total = sum(inst.inflight for inst in self._instances.values())
        if (
            least is not None
            and self.inflight(candidates[least][0]) * len(self._instances) <= total
        ):
            return least
        return None

    def inflight(self, instance_id: str) -> int:
        """Live reservations of one instance (what a forced reserve compares)."""
        return self._instances[instance_id].inflight


class NodeView:
    """One node's view of a SharedState, kept as a node's PoolCache keeps it.

    `ensure` is Coordinator._ensure_view: the whole state is read again when the last
    read is older than `max_age_ms` (0: before every decision) or liveness is due
    (`live_refresh_ms`, 0: every time), and only a liveness read brings new hints.
    Between reads, a reply of this node's own scripts rewrites the record of the
    instance it touched (`patch`: the current counters of that instance, peers'
    reservations included, as reserve.lua's and the carried transitions' records do);
    every other row stays as read.
    """

    def __init__(self, state: SharedState, max_age_ms: int, live_refresh_ms: int) -> None:
        self.state = state
        self.max_age_ms = max_age_ms
        self.live_refresh_ms = live_refresh_ms
        self.rows: dict[str, InstanceRow] = {}
        self.reads = 0  # whole-state reads (decisions, reserve retries)
        self._hints: dict[str, dict[str, Hint]] = {}
        self._read_ms: int | None = None
        self._live_ms: int | None = None

    def ensure(self, now_ms: int) -> None:
        """Read the state if it is too old to decide on, or its liveness is due."""
        live = self._live_ms is None or now_ms - self._live_ms >= self.live_refresh_ms
        if (
            live
            or self._read_ms is None
            or self.max_age_ms == 0
            or now_ms - self._read_ms > self.max_age_ms
        ):
            self.read(now_ms, live=live)

    def read(self, now_ms: int, *, live: bool = False) -> None:
        """The whole state now (read_state, or a reserve reply other than 'ok')."""
        rows = self.state.rows()
        if live:
            self._live_ms = now_ms
            self._hints = {row.id: row.hints for row in rows}
        self.rows = {row.id: self._seen(row) for row in rows}
        self._read_ms = now_ms
        self.reads += 1

    def patch(self, instance_id: str) -> None:
        """A reply of this node's scripts rewrote this instance's record."""
        if self._read_ms is None:
            return
        self.rows[instance_id] = self._seen(self.state.row(instance_id))

    def _seen(self, row: InstanceRow) -> InstanceRow:
        """The row with the hints of the last liveness read."""
        hints = self._hints.get(row.id, {})
        return row if row.hints == hints else replace(row, hints=hints)
