"""The node-side view of a pool: specs read on change, packed state on every decision."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.models import InstanceLoad, InstanceRow, InstanceSpec
from coordinator.packed import (
    LIVE_BYTES,
    STATE_BYTES,
    LiveRecord,
    as_bytes,
    as_text,
    changed_slots,
    unpack_live,
    unpack_state,
)
from coordinator.timing import (
    ResolvedPool,
    TimingInputs,
    TimingPolicy,
    TimingSource,
    resolve_pool,
)

log = logging.getLogger(__name__)


def _spliced(state: bytes, slot: int, record: bytes) -> bytes:
    """`state` with the record of `slot` replaced."""
    offset = slot * STATE_BYTES
    return state[:offset] + record + state[offset + STATE_BYTES :]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A pool's pressure at one Redis time: exactly what selection scores."""

    now_ms: int
    version: int
    rows: list[InstanceLoad]
    coordination: str = "ok"

    def by_id(self) -> dict[str, InstanceLoad]:
        """Rows keyed by instance id."""
        return {row.id: row for row in self.rows}

    def inflight_of(self, instance_id: str) -> int | None:
        """Requests in flight on one instance as Redis holds them (0 when the pool has
        no such instance); None in degraded mode, whose rows count this node's alone:
        an unknown count is never 0 (a drain must not end on it)."""
        if self.coordination != "ok":
            return None
        row = next((r for r in self.rows if r.id == instance_id), None)
        return 0 if row is None else row.inflight or 0


@dataclass(slots=True)
class SpecEntry:
    """What changes only at registration: the spec, epoch, capacity and record slot."""

    spec: InstanceSpec
    epoch: int
    max_slots: int
    slot: int


@dataclass
class PoolCache:
    """One node's view of a pool: specs by id, and the packed records by slot.

    Specs are read only when the pool's spec_gen moves (read_specs). The packed
    `state` comes whole with read_state and with a reserve reply that did not
    reserve (stale, full, ...) to a view that is behind; reserve, mark_first_token
    and release answer with the one record they rewrote and the `state_ver` it took
    the pool to. A record that directly follows the view's version moves the view
    on; a later one is applied to its slot and kept in `ahead`, so a whole view of
    an older version never undoes it. `live` is read at a bounded rate. A row is
    rebuilt only when its record bytes changed.
    """

    run_id: str = ""
    spec_gen: int = -1  # spec_gen whose changes are applied (-1: none read yet)
    seen_spec_gen: int = 0  # the newest spec_gen a reply reported
    now_ms: int = 0
    clock_mono: float = 0.0  # when now_ms was read
    refreshed_mono: float = 0.0  # when the view was last whole and current
    live_mono: float = -1e18  # when `live` was last read
    rows: dict[str, InstanceRow] = field(default_factory=dict)
    entries: dict[str, SpecEntry] = field(default_factory=dict)
    slot_ids: dict[int, str] = field(default_factory=dict)
    state: bytes = b""
    state_ver: int = -1  # every record of `state` is at least this new (-1: none read)
    seen_state_ver: int = -1  # the newest state_ver a reply reported
    ahead: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # slot: newer record
    live: bytes = b""
    # Decoded `live` records by slot: a patch of `state` rebuilds a row without
    # decoding its unchanged liveness again. Dropped for the slots `live` changes.
    live_records: dict[int, LiveRecord] = field(default_factory=dict)
    rows_applied: int = 0  # rows rebuilt since start (for benchmarks)
    dirty: set[str] = field(default_factory=set)  # ids changed since the ranker last synced
    membership: int = 0  # bumps whenever an id is added or removed
    # Learned timing (coordinator/timing.py): records by field as last merged, and each
    # row's resolved timing, keyed by what it was resolved from.
    timing_policy: TimingPolicy = field(default_factory=TimingPolicy)
    learned: dict[str, list[float]] = field(default_factory=dict)
    pool_timing: InstanceSpec | None = None
    _resolved: dict[str, tuple[InstanceSpec, int, InstanceSpec, TimingSource]] = field(
        default_factory=dict
    )
    _stale: bool = False
    _specs: dict[str, InstanceSpec] = field(default_factory=dict)  # parsed, by JSON text

    @property
    def view_token(self) -> str:
        """What reserve is told of this view: '<run_id>:<state_ver>', or '' for none."""
        return f"{self.run_id}:{self.state_ver}" if self.state_ver >= 0 else ""

    def reserve_token(self, lean_bytes: int) -> str:
        """view_token as reserve takes it: prefixed '~' while this view missed a change
        per instance (least_load then ranks a random sample) and holds a `state` over
        `lean_bytes`: a refused reserve then brings no whole state, which would cost
        the server a copy through Lua; the next sample is decided on Redis's counters
        anyway, and whole reads come by age, outside Lua (read_state)."""
        token = self.view_token
        if token and len(self.state) > lean_bytes and self.missed_changes >= len(self.rows):
            return "~" + token
        return token

    @property
    def slots_token(self) -> str:
        """The run and spec_gen this view's slots were read at, '<run_id>:<spec_gen>'
        (reserve trusts the slots sent while they are the pool's), or '' for none."""
        return f"{self.run_id}:{self.spec_gen}" if self.spec_gen >= 0 else ""

    @property
    def missed_changes(self) -> int:
        """Changes of `state` replies reported that this view has not applied in order:
        how far behind the view is (its records ahead count as missed too)."""
        return max(0, self.seen_state_ver - self.state_ver) if self.state_ver >= 0 else 0

    @property
    def specs_behind(self) -> bool:
        """Whether a reply reported spec changes this cache has not read yet."""
        return self.spec_gen != self.seen_spec_gen

    def reset(self, run_id: str) -> None:
        """Redis lost the pool (restart, failover to an empty replica): start over."""
        self.rows.clear()
        self.entries.clear()
        self.slot_ids.clear()
        self._resolved.clear()
        self.state = self.live = b""
        self.live_records.clear()
        self.state_ver = self.seen_state_ver = -1
        self.ahead.clear()
        self.live_mono = -1e18  # liveness must be read again
        self.membership += 1
        self.run_id = run_id
        self.spec_gen = -1
        # Another server (a failover) may run a clock behind the old one: the
        # highest time seen belongs to the old run.
        self.now_ms = 0

    def apply_view(
        self,
        run_id: Any,
        spec_gen: Any,
        now_ms: Any,
        state: Any,
        live: Any = None,
        state_ver: Any = -1,
        slot: Any = -1,
        record: Any = None,
        *,
        issued_ver: int = -1,
    ) -> None:
        """Merge a read_state reply or a reserve reply's view.

        A reserve reply without `state` (None or False) carries one record
        (`slot`, `record`: apply_patch), or slot -1 when this view was current.
        `issued_ver` is the view's state_ver when the call was sent: a whole state
        older than that is not a late reply but Redis gone back (see _take_state).
        """
        run = as_text(run_id)
        if run != self.run_id:
            self.reset(run)
        self.seen_spec_gen = int(spec_gen)
        self.now_ms = max(self.now_ms, int(now_ms))
        self.clock_mono = time.monotonic()
        touched: set[int] = set()
        if state is not None and state is not False:
            touched.update(self._take_state(as_bytes(state), int(state_ver), issued_ver))
        elif int(slot) >= 0:
            self.apply_patch(state_ver, slot, record)
        elif int(state_ver) == self.state_ver:  # the script found this view current
            self._current()
            self._stale = False
        else:  # a refusal to a view far behind ('~' token): how far it is now
            self.seen_state_ver = max(self.seen_state_ver, int(state_ver))
        if live is not None and live is not False:
            self.live_mono = self.clock_mono
            new_live = as_bytes(live)
            if new_live != self.live:
                changed = changed_slots(self.live, new_live, LIVE_BYTES)
                for slot in changed:
                    self.live_records.pop(slot, None)
                touched.update(changed)
                self.live = new_live
        self._rebuild(touched)

    def _take_state(self, state: bytes, version: int, issued_ver: int) -> list[int]:
        """Adopt a whole `state` unless this view is newer; returns the changed slots."""
        if version < issued_ver:
            # Read after the view reached `issued_ver`, yet older: Redis lost changes
            # but kept the run_id (a failover to a replica that lagged, an AOF
            # restart). Its history is the pool's now; refusing it would keep this
            # view wrong until as many changes happened again.
            self.ahead.clear()
            self.state_ver = self.seen_state_ver = -1
        if version < self.state_ver:
            return []  # a late reply: the view has moved past it
        self.seen_state_ver = max(self.seen_state_ver, version)
        for slot, (newer, record) in list(self.ahead.items()):
            if newer > version:
                state = _spliced(state, slot, record)
            else:
                del self.ahead[slot]
        changed = changed_slots(self.state, state, STATE_BYTES) if state != self.state else []
        self.state, self.state_ver = state, version
        self._current()
        self._stale = False
        return changed

    def apply_patch(self, state_ver: Any, slot: Any, record: Any) -> None:
        """Apply one script's rewritten record of `state` (see the class docstring)."""
        version, slot, new = int(state_ver), int(slot), as_bytes(record)
        self.seen_state_ver = max(self.seen_state_ver, version)
        if (
            self.state_ver < 0
            or version <= self.state_ver
            or len(new) != STATE_BYTES
            or not 0 <= slot * STATE_BYTES <= len(self.state) - STATE_BYTES
            or self.ahead.get(slot, (-1, b""))[0] >= version
        ):
            return
        self.state = _spliced(self.state, slot, new)
        if version == self.state_ver + 1 and not self.ahead:  # the usual case: next in line
            self.state_ver = version
            self._current()
            self._rebuild([slot])
            return
        self.ahead[slot] = (version, new)
        while True:  # records held ahead that now follow on
            follows = [s for s, (v, _) in self.ahead.items() if v == self.state_ver + 1]
            if not follows:
                break
            del self.ahead[follows[0]]
            self.state_ver += 1
            self._current()
        self._rebuild([slot])

    def _current(self) -> None:
        self.refreshed_mono = time.monotonic()

    def _rebuild(self, slots: Iterable[int]) -> None:
        for slot in slots:
            iid = self.slot_ids.get(slot)
            if iid is not None:
                self._build(iid)

    def apply_specs(self, entries: list[Any], *, full: bool = False) -> None:
        """Merge read_specs entries {id, spec|false, epoch, max_slots, slot}...

        With `full`, `entries` is every registered instance: others are dropped.
        """
        seen: set[str] = set()
        for k in range(0, len(entries), 5):
            iid, raw, epoch, max_slots, slot = entries[k : k + 5]
            iid = as_text(iid)
            seen.add(iid)
            spec = None if raw is None or raw is False else self._parse(iid, as_text(raw))
            if spec is None:
                self._drop(iid)
                continue
            old = self.entries.get(iid)
            if old is not None and old.slot != int(slot):
                self.slot_ids.pop(old.slot, None)
            self.entries[iid] = SpecEntry(spec, int(epoch), int(max_slots), int(slot))
            self.slot_ids[int(slot)] = iid
            if old is None or old.slot != int(slot):
                self.membership += 1
            self._build(iid)
            if not self.rows[iid].last_seen_ms:
                self.live_mono = -1e18  # registered after `live` was read: read it now
        if full:
            for iid in [i for i in self.entries if i not in seen]:
                self._drop(iid)

    def _drop(self, iid: str) -> None:
        self._resolved.pop(iid, None)
        entry = self.entries.pop(iid, None)
        if entry is not None and self.slot_ids.get(entry.slot) == iid:
            del self.slot_ids[entry.slot]
        if self.rows.pop(iid, None) is not None:
            self.membership += 1

    def _parse(self, iid: str, spec_json: str) -> InstanceSpec | None:
        spec = self._specs.get(spec_json)
        if spec is not None:
            return spec
        try:
            spec = InstanceSpec.from_dict(json.loads(spec_json))
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # A row that got into Redis past validation (written directly, or by an
            # older version) must not break selection: leave it out.
            log.warning("ignoring instance %r: invalid stored spec (%s)", iid, exc)
            return None
        if len(self._specs) > 4 * max(64, len(self.entries)):
            self._specs.clear()
        self._specs[spec_json] = spec
        return spec

    def _build(self, iid: str) -> None:
        """(Re)build one row from its spec entry and its packed records."""
        entry = self.entries[iid]
        state = unpack_state(self.state, entry.slot)
        live = self.live_records.get(entry.slot)
        if live is None:
            live = self.live_records[entry.slot] = unpack_live(self.live, entry.slot)
        self.rows_applied += 1
        self.dirty.add(iid)
        spec, timing = self._timing_of(iid, entry)
        self.rows[iid] = InstanceRow(
            id=iid,
            spec=spec,
            epoch=entry.epoch,
            last_seen_ms=live.last_seen_ms,
            max_slots=entry.max_slots,
            inflight=state.inflight,
            pending_prefill=state.pending_prefill,
            active_decode=state.active_decode,
            prefill_free_at_ms=state.prefill_free_at_ms,
            earliest_end_at_ms=state.earliest_end_at_ms or None,
            hints=live.hints,
            timing=timing,
            started=state.started,
        )

    def _timing_of(self, iid: str, entry: SpecEntry) -> tuple[InstanceSpec, TimingSource]:
        """The spec with resolved timing; resolved again only when its inputs changed."""
        known = self._resolved.get(iid)
        if known is not None and known[0] is entry.spec and known[1] == entry.epoch:
            return known[2], known[3]
        spec, source = self.timing_policy.resolve(
            entry.spec, entry.epoch, self.learned.get(iid), self.pool_timing
        )
        self._resolved[iid] = (entry.spec, entry.epoch, spec, source)
        return spec, source

    def timing_inputs(self) -> TimingInputs:
        """Each instance's configured spec and epoch: what resolve_pool resolves."""
        return {iid: (e.spec, e.epoch) for iid, e in self.entries.items()}

    def apply_learned(
        self, records: dict[str, list[float]], resolved: ResolvedPool | None = None
    ) -> None:
        """Take the pool's merged timing records; rebuild the rows whose timing changed.

        `resolved` is what resolve_pool answered for these records on the
        `timing_inputs()` given with it, computed aside (in a worker thread: at 10,000
        instances it takes the CPU for about 100 ms); an instance whose spec or epoch
        changed since is resolved here. Without it, everything is resolved here.
        """
        self.learned = records
        if resolved is None:
            inputs = self.timing_inputs()
            resolved = (inputs, *resolve_pool(self.timing_policy, inputs, records))
        inputs, self.pool_timing, timings = resolved
        for iid, entry in self.entries.items():
            used = inputs.get(iid)
            if used is not None and used[0] is entry.spec and used[1] == entry.epoch:
                timing = timings[iid]
            else:
                timing = self.timing_policy.resolve(
                    entry.spec, entry.epoch, records.get(iid), self.pool_timing
                )
            known = self._resolved.get(iid)
            self._resolved[iid] = (entry.spec, entry.epoch, *timing)
            if iid in self.rows and (known is None or timing != known[2:]):
                self._build(iid)

    def take(self, other: PoolCache) -> None:
        """Become `other` (a view read aside), as one change of membership."""
        membership = self.membership
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(other, name))
        self.membership = membership + 1 + other.membership
        self.dirty = set(self.rows)

    def invalidate(self) -> None:
        """Force the next decision to re-read (after a change that carried no view)."""
        self._stale = True

    def live_age_ms(self) -> float:
        """Milliseconds since `live` (liveness, hints) was read."""
        return (time.monotonic() - self.live_mono) * 1000

    def estimated_now_ms(self) -> int:
        """Redis time now, extrapolated from the last reply with the local monotonic clock."""
        return self.now_ms + int((time.monotonic() - self.clock_mono) * 1000)

    def age_ms(self) -> float:
        """Milliseconds since the last view was applied (infinite once invalidated)."""
        if self._stale:
            return float("inf")
        return (time.monotonic() - self.refreshed_mono) * 1000
