"""The Coordinator: the public asyncio API of one node in one pool."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coordinator.connection import close_redis, connect_redis
from coordinator.errors import (
    CoordinationUnavailableError,
    EpochFencedError,
    InvalidArgumentError,
    NoInstanceError,
    PoolFullError,
    RedisRefusedError,
    ScriptArgumentError,
    UnknownInstanceError,
    WriteRefusedError,
    from_response_error,
    refusal,
)
from coordinator.fastrank import ColumnarPool
from coordinator.guard import guard_bounds
from coordinator.held_records import HeldRecords, failed, record_args, settled
from coordinator.keys import COLUMNS, ID_RE, POOL_NAME_RE, PoolKeys
from coordinator.models import (
    HINT_NAMES,
    MAX_PREDICTED_MS,
    InstanceLoad,
    InstanceRow,
    InstanceSpec,
    RequestShape,
    Reservation,
)
from coordinator.outliers import (
    CONSECUTIVE_OFF,
    Outcome,
    OutlierPolicy,
    OutlierView,
    parse_outliers,
)
from coordinator.packed import NO_SLOT, as_text, pack_candidate
from coordinator.prefix import cheap_copy_tokens, guarded_cached_tokens, idle_fleet_room
from coordinator.prefix_index import PrefixIndex
from coordinator.pressure import instance_load
from coordinator.scripts import Scripts
from coordinator.server_identity import identity_of
from coordinator.settings import STRATEGIES, Settings
from coordinator.snapshot import PoolCache, Snapshot
from coordinator.strategies import Ranking, RoundRobin, Score, crowded_last, eligible, rank
from coordinator.tasks import raise_if_cancelling, stop_task
from coordinator.timing import (
    DEFAULT_OUTPUT_TOKENS,
    Observations,
    TimingPolicy,
    expected_output,
    flush_interval_ms,
    pack,
    resolve_pool,
    unpack,
)

log = logging.getLogger(__name__)

UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    # CLUSTERDOWN, MASTERDOWN (a Sentinel-watched replica's too), and "TTL exhausted":
    # redirects that did not settle, as while the pool's slot migrates between shards
    ClusterError,
    TryAgainError,
    AskError,  # and MovedError: a redirect that kept failing (see _read_state)
    RedisClusterException,
    OSError,
)
MAX_TOKENS = 10_000_000
MAX_CORDON_REASON = 200  # bytes of an operator's cordon reason (lua/record_outcome.lua)
NOSCRIPT_RETRIES = 3  # extra loads when scripts are flushed again mid-call
REDIRECT_RETRIES = 2  # read_state sent again after MOVED or ASK (Redis Cluster)
SPEC_READ_STEP = 250  # instances per read_specs call: about 2 ms at 10k instances
# Void records one sweep call may delete (3-12 us each: 500 took 5.8 ms on a slow spell).
SWEEP_STEP = 250
TIMING_MAX_AGE_MS = 86_400_000  # a pool's learned timing expires after a day unmerged
# Timing batches merged per merge_timing call: about 25 µs of Redis time each, so a
# call stays near 1 ms (a busy node on a big pool can hold a batch for every instance).
TIMING_STEP = 32
# Held marks and releases one call carries: 20-50 µs of Redis time each, so a burst
# of completions (an engine that dropped its streams) goes in bounded calls.
CARRY_STEP = 32
# Instances whose counters, and reservations whose node, one audit step checks
# (lua/renew_lease.lua allows 256).
AUDIT_STEP = 64
# reserve's arguments before its candidates, and per candidate: the id and its packed
# slot, prefill_ms, decode_ms and three guard bounds (lua/reserve.lua,
# coordinator/packed.py pack_candidate, coordinator/guard.py).
RESERVE_HEAD_ARGS = 12
# A refused reserve to a view far behind brings the whole `state` only up to this
# size (170 instances): copying more through Lua costs the server more than the
# sampled retry it would serve (PoolCache.reserve_token).
LEAN_STATE_BYTES = 4096
CANDIDATE_ARGS = 2
# A node that finds its id shared logs it at most this often (it counts every time).
NODE_ID_CONFLICT_LOG_S = 60.0
# Reservations one reap_node call may release (40-115 us each at 10k instances: 50 took
# 5.7 ms on a slow spell of this 2-core VM, so half that keeps a step below 5 ms).
REAP_STEP = 25


@dataclass(slots=True)
class LocalReservation:
    """This node's own view of a live reservation; re-asserted after Redis returns."""

    rid: str
    instance_id: str
    epoch: int
    phase: str
    prompt_tokens: int
    expected_output_tokens: int
    prefill_ms: int
    decode_ms: int
    in_redis: bool


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What a registration did."""

    instance_id: str
    epoch: int
    status: str  # new | updated | restarted | local (degraded)
    voided_reservations: int


@dataclass
class Stats:
    """Counters a node exports as metrics."""

    reaped: int = 0
    degraded_entries: int = 0
    reserve_retries: int = 0
    forced_reserves: int = 0
    queue_waiting: int = 0
    lease_losses: int = 0  # own lease found expired or gone: re-asserted
    pool_losses: int = 0  # run_id changed: Redis lost the pool
    write_refusals: int = 0  # OOM / READONLY / MISCONF / NOREPLICAS replies
    unrestorable: int = 0  # reservations a re-assert could not restore
    carry_calls: int = 0  # held marks and releases sent in their own call (no reserve came)
    node_id_conflicts: int = 0  # renewals that found another process renewed this lease
    server_changes: int = 0  # calls that reached another Redis server process: re-asserted
    audit_resets: int = 0  # pools this node's audit found inconsistent and cleared
    orphans_released: int = 0  # reservations this node's audit found with no node left


# read_state's reply: a view (PoolCache.apply_view's fields), then the leased nodes.
READ_STATE_VIEW = 6


_STATE_KEY, _LIVE_KEY = COLUMNS.index("state"), COLUMNS.index("live")


def read_state_gets(keys: list[Any], args: list[Any]) -> list[Any]:
    """The keys a `read_state` call reads by GET after the script, in its MULTI/EXEC:
    `state`, and `live` when its one argument is true (Coordinator._read_state)."""
    state = keys[_STATE_KEY]
    return [state, keys[_LIVE_KEY]] if args and int(args[0]) else [state]


class Coordinator:
    """One node's handle on one pool: registry, snapshot, reservations, lease."""

    def __init__(
        self,
        redis: Any,
        *,
        pool: str,
        node_id: str | None = None,
        settings: Settings | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(pool, str) or not POOL_NAME_RE.fullmatch(pool):
            raise InvalidArgumentError(
                f"pool name {pool!r} must match {POOL_NAME_RE.pattern} (no braces)"
            )
        node_id = node_id or f"node-{uuid.uuid4().hex[:12]}"
        if not ID_RE.fullmatch(node_id):
            raise InvalidArgumentError(f"node id {node_id!r} must match {ID_RE.pattern}")
        self.redis = redis
        self.pool = pool
        self.node_id = node_id
        self.settings = settings or Settings()
        self.keys = PoolKeys(self.settings.key_prefix, pool)
        self.scripts = Scripts.register(redis)
        # Redis Cluster: a key of the pool, which names its shard (_load_script).
        self._shard = self.keys.column("meta") if isinstance(redis, RedisCluster) else None
        self.stats = Stats()
        # Pre-encoded: every script call sends all 16 column names, and re-encoding
        # them per call was a measurable share of the decision cost.
        self._columns = [key.encode() for key in self.keys.columns]
        self._node_rids = self.keys.node_rids(node_id).encode()
        self._prefix_key = self.keys.prefix_index().encode()
        self._cache = self._new_cache()
        self.observations = Observations()  # timing samples not yet merged into Redis
        self._live_nodes = 1  # nodes with a lease, as the last merge or read counted them
        # Nodes start their rotation at different places (stable per node id), so
        # simultaneous first picks of an idle pool rarely collide.
        self._rr = RoundRobin(zlib.crc32(node_id.encode()))
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)  # stale_sample's draws
        self._local: dict[str, LocalReservation] = {}
        self._pending_releases: set[str] = set()
        # first_token_soon/release_soon held for the next reserve: (op, rid, held),
        # op 'f' or 'r'; `held` is the local reservation a release dropped.
        self._carry: list[tuple[str, str, LocalReservation | None]] = []
        self._records = HeldRecords()  # prefix records, which ride along the same way
        self._carry_flush: asyncio.Task[None] | None = None
        # One decision at a time per node: concurrent decisions of one node would all
        # rank on the same view and pick the same instance (herding within a node).
        self._decide = asyncio.Lock()
        self._columns_view = ColumnarPool()
        self._registered: dict[str, InstanceSpec] = {}
        self._degraded = False
        self._alive_when_degraded: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._recovery: asyncio.Task[None] | None = None
        # Lease bookkeeping. Once a node has held a lease, a lease found expired or
        # missing means peers may have reaped its reservations: it must re-assert.
        self._leased = False
        self._reasserting = False
        # Set while re-assertion restores what its first pass left: new reservations
        # wait for it instead of adding local ones it would have to chase.
        self._restoring_tail: asyncio.Event | None = None
        self._lease_lost = False  # seen expired while re-asserting: start over
        self._renewed_mono = 0.0
        # This process's mark on its lease (lua/renew_lease.lua): another one found there
        # after this process renewed means a second process runs under the same node id.
        self._incarnation = os.urandom(8).hex()
        # The Redis server process this node's calls reach (None: not told apart).
        self._identity = identity_of(redis)
        self._server_changes = self._identity.changes if self._identity else 0
        self._renewed_own = False
        self._shared_mono: float | None = None  # when that was last seen
        self._shared_said_mono: float | None = None  # and last logged
        self._voids_left = 0  # instances with void records to sweep, per renew_lease
        self.on_reaped: Callable[[int], None] | None = None
        self.prefix = PrefixIndex(
            redis,
            self.keys,
            self.settings,
            self.hold_record,
            self._epoch_of,
            self._prefix_capacity,
            lambda: self._degraded,
            lambda: self._cache.estimated_now_ms(),
        )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        redis_url: str,
        pool: str = "default",
        node_id: str | None = None,
        settings: Settings | None = None,
        *,
        background: bool = True,
    ) -> Coordinator:
        """Connect to Redis and start the lease/reaper task (degraded if Redis is down)."""
        settings = settings or Settings.from_env()
        coordinator = cls(
            connect_redis(redis_url, settings), pool=pool, node_id=node_id, settings=settings
        )
        with suppress(CoordinationUnavailableError):
            # A node restarting under its old id: nothing else would ever reap what its
            # predecessor held, since this process renews the same lease.
            await coordinator.reap_node(coordinator.node_id, force=True)
            await coordinator.renew_lease()
            await coordinator.refresh()
        if background:
            coordinator.start_background()
        return coordinator

    def start_background(self) -> None:
        """Start the lease renewal and reaper loop, and the learned-timing merge loop."""
        if not self._tasks:
            self._tasks.append(asyncio.create_task(self._lease_loop(), name="coordinator-lease"))
            self._tasks.append(asyncio.create_task(self._timing_loop(), name="coordinator-timing"))

    def _new_cache(self) -> PoolCache:
        s = self.settings
        policy = TimingPolicy(
            min_samples=s.timing_min_samples,
            pinned=s.timing_pinned,
            half_life_ms=s.timing_half_life_ms,
        )
        return PoolCache(timing_policy=policy)

    async def close(self) -> None:
        """Stop background tasks and close the Redis client (reservations stay until released)."""
        await self.flush_carried()
        tasks = [*self._tasks, *([self._recovery] if self._recovery else [])]
        if self._carry_flush is not None:
            tasks.append(self._carry_flush)
            self._carry_flush = None
        for task in tasks:
            task.cancel()
        for task in tasks:  # again if a cancel got swallowed (coordinator.tasks)
            await stop_task(task)
        self._tasks.clear()
        self._recovery = None
        await close_redis(self.redis)

    @property
    def coordination(self) -> str:
        """`ok` while Redis answers, `degraded` while the node runs on local state."""
        return "degraded" if self._degraded else "ok"

    @property
    def local_reservations(self) -> dict[str, LocalReservation]:
        """This node's live reservations (read-only use)."""
        return self._local

    def _epoch_of(self, instance_id: str) -> int | None:
        row = self._cache.rows.get(instance_id)
        return None if row is None else row.epoch

    def _prefix_capacity(self, instance_id: str) -> int | None:
        row = self._cache.rows.get(instance_id)
        return None if row is None else row.spec.prefix_cache_tokens

    # ------------------------------------------------------------------ redis calls

    async def _call(
        self, name: str, args: list[Any], extra_keys: tuple[str | bytes, ...] = ()
    ) -> Any:
        """Run one script; map its errors; a connection failure turns on degraded mode."""
        if self._degraded:
            raise CoordinationUnavailableError("coordination is degraded")
        try:
            return await self._direct_call(name, args, extra_keys)
        except RedisRefusedError as exc:
            if isinstance(exc, WriteRefusedError):
                self.stats.write_refusals += 1
            self._enter_degraded(exc)
            raise
        except UNAVAILABLE as exc:
            self._enter_degraded(exc)
            raise CoordinationUnavailableError(str(exc)) from exc
        finally:
            self._check_server()

    def _check_server(self) -> None:
        """Re-assert when the client reached another Redis server process since the
        last call (coordinator/server_identity.py): a restart from persistence files
        or a failover, which may have lost this node's latest writes."""
        identity = self._identity
        if identity is None or identity.changes == self._server_changes:
            return
        self._server_changes = identity.changes
        self.stats.server_changes += 1
        self._enter_degraded(
            "redis is another server process now (a restart or a failover): re-asserting"
        )

    def _enter_degraded(self, cause: object) -> None:
        """Serve from local state and re-assert it in the background (DESIGN.md §5)."""
        if self._degraded:
            return
        log.warning("coordination degraded: %s", cause)
        now = self._cache.estimated_now_ms()
        ttl = self.settings.instance_ttl_ms
        self._alive_when_degraded = {
            iid for iid, row in self._cache.rows.items() if now - row.last_seen_ms <= ttl
        }
        self._degraded = True
        for spec in self._registered.values():
            if spec.id not in self._cache.rows:  # what this node registered, at least
                self._remember_locally(spec)
        self.stats.degraded_entries += 1
        if self._recovery is None or self._recovery.done():
            with suppress(RuntimeError):
                self._recovery = asyncio.create_task(self._recover(), name="coordinator-recover")

    # ------------------------------------------------------------------ registry

    async def register_instance(self, spec: InstanceSpec) -> RegisterResult:
        """Register or update an instance; a higher epoch voids older reservations."""
        if not isinstance(spec, InstanceSpec):
            raise InvalidArgumentError("register_instance expects an InstanceSpec")
        try:
            reply = await self._call(
                "register", [spec.id, spec.to_json(), spec.max_slots, spec.epoch]
            )
        except CoordinationUnavailableError:
            # Re-asserted when Redis answers again; a refused (fenced) spec never is.
            self._registered[spec.id] = spec
            self._remember_locally(spec)
            return RegisterResult(spec.id, spec.epoch or 1, "local", 0)
        status, epoch, voided = str(reply[0]), int(reply[1]), int(reply[2])
        self._registered[spec.id] = replace(spec, epoch=epoch)
        self._cache.invalidate()
        if voided:
            self._forget_instance_epochs(spec.id, epoch)
        return RegisterResult(spec.id, epoch, status, voided)

    def _remember_locally(self, spec: InstanceSpec) -> None:
        """Degraded registration: make the instance selectable from local state."""
        current = self._cache.rows.get(spec.id)
        epoch = spec.epoch or (current.epoch if current else 1)
        self._cache.rows[spec.id] = InstanceRow(
            id=spec.id,
            spec=spec,
            epoch=epoch,
            last_seen_ms=self._cache.estimated_now_ms(),
            max_slots=spec.max_slots,
            inflight=0,
            pending_prefill=0,
            active_decode=0,
            prefill_free_at_ms=0,
            earliest_end_at_ms=None,
        )
        self._cache.membership += 1
        self._alive_when_degraded.add(spec.id)

    def _forget_instance_epochs(self, instance_id: str, epoch: int) -> None:
        for rid, res in list(self._local.items()):
            if res.instance_id == instance_id and res.epoch != epoch:
                del self._local[rid]

    async def heartbeat_instance(
        self, instance_id: str, hints: dict[str, float] | None = None
    ) -> int:
        """Refresh liveness and store hints; raises UnknownInstanceError. Returns the epoch."""
        hints = hints or {}
        unknown = set(hints) - set(HINT_NAMES)
        if unknown:
            raise InvalidArgumentError(f"unknown hints {sorted(unknown)}; known: {HINT_NAMES}")
        values = []
        for name in HINT_NAMES:
            value = hints.get(name)
            try:
                valid = value is None or (
                    not isinstance(value, bool)
                    and isinstance(value, int | float)
                    and 0 <= float(value) < float("inf")
                )
            except OverflowError:  # an int beyond float range
                valid = False
            if not valid:
                raise InvalidArgumentError(
                    f"hint {name} must be a finite number >= 0, got {value!r}"
                )
            values.append("" if value is None else repr(float(value)))
        reply = await self._call("heartbeat", [instance_id, *values])
        return int(reply[1])

    async def unregister_instance(self, instance_id: str) -> int:
        """Remove an instance; returns how many reservations were voided."""
        self._registered.pop(instance_id, None)
        try:
            reply = await self._call(
                "unregister", [instance_id], (self.keys.outliers(), self.keys.ejected())
            )
        finally:
            # Whatever happened, this node's cache may still list the instance: the
            # next decision must re-read rather than send it to the reserve script.
            self._cache.invalidate()
        self._forget_instance_epochs(instance_id, -1)
        return int(reply[1])

    async def list_instances(self, include_dead: bool = False) -> list[InstanceLoad]:
        """Registered instances with their pressure; dead ones only when asked."""
        snap = await self.snapshot()
        return [row for row in snap.rows if include_dead or row.alive]

    # ------------------------------------------------------------------ snapshot

    async def refresh(self, *, live: bool | None = None) -> None:
        """Read the pool's packed state (and liveness when due); then any spec changes."""
        for _ in range(2):
            due = self._live_due() if live is None else live
            issued = self._cache.state_ver
            reply = await self._call("read_state", [int(due)])
            if not self._apply(reply[:READ_STATE_VIEW], issued):
                raise CoordinationUnavailableError("redis lost the pool: re-asserting")
            self._live_nodes = max(1, int(reply[READ_STATE_VIEW]))
            if self._cache.specs_behind:
                await self._read_specs(self._call)
            # Liveness comes again when the view started over or gained instances.
            if due or not self._live_due():
                return

    def snapshot_max_age_ms(self) -> float:
        """How old the view may grow before a decision re-reads the whole state:
        snapshot_max_age_ms while the pool has at most snapshot_nodes live nodes,
        proportionally longer beyond, so the fleet's whole reads per second stay about
        what snapshot_nodes nodes make (each of 64 nodes decides for 1/64 of the
        traffic: its view falls behind whatever its age, and a stale answer still
        brings the whole state when the view misled it)."""
        s = self.settings
        return s.snapshot_max_age_ms * max(1.0, self._live_nodes / s.snapshot_nodes)

    def _live_due(self) -> bool:
        # Never older than a quarter of the instance TTL: liveness is judged from it.
        s = self.settings
        return self._cache.live_age_ms() >= min(s.live_refresh_ms, s.instance_ttl_ms / 4)

    async def _ensure_view(self) -> bool:
        """Make the cache fit to decide on; True when it re-read the pool state."""
        s = self.settings
        if (
            s.snapshot_max_age_ms == 0
            or self._cache.age_ms() > self.snapshot_max_age_ms()
            or self._live_due()
        ):
            await self.refresh()
            return True
        if self._cache.specs_behind:
            await self._read_specs(self._call)
            if self._live_due():
                await self.refresh()
            return True
        return False

    def _apply(self, view: list[Any], issued_ver: int, carried: Sequence[Any] = ()) -> bool:
        """Merge a view; False (and a re-assert) when Redis lost the pool meanwhile.

        A new run_id means FLUSHDB, eviction or a failover to an empty replica: the
        same loss as a restart, so the node re-registers and re-asserts as after an
        outage. The cache keeps its rows until then: degraded mode selects from them.
        """
        run = view[0].decode() if isinstance(view[0], bytes) else str(view[0])
        if self._cache.run_id and run != self._cache.run_id:
            # Only the re-assert's own read switches runs: a late reply of either
            # run must not empty the rows degraded selection depends on.
            if not self._reasserting:
                self.prefix.seen.clear()  # its counts start again from 0
                if not self._degraded:
                    self.stats.pool_losses += 1
                self._enter_degraded(f"redis lost the pool (run_id {self._cache.run_id} -> {run})")
            return False
        self._apply_carried(carried)  # their changes precede the view's
        self._cache.apply_view(*view, issued_ver=issued_ver)
        return True

    async def _read_specs(
        self, call: Callable[..., Awaitable[Any]], cache: PoolCache | None = None
    ) -> None:
        """Bring a view's specs (the node's by default) up to the pool's spec_gen, in steps."""
        cache = cache or self._cache
        since, cursor, full = max(cache.spec_gen, 0), "", False
        gen = since
        collected: list[Any] = []
        while True:
            reply = await call("read_specs", [since, cursor, SPEC_READ_STEP])
            mode, nxt, entries = as_text(reply[2]), as_text(reply[3]), list(reply[4])
            if as_text(reply[0]) != cache.run_id:
                return  # the pool was lost meanwhile: the next view starts over
            if mode == "delta":
                cache.apply_specs(entries)
                if not nxt:
                    cache.spec_gen = int(reply[1])
                    return
                since = int(nxt)
                continue
            if not full:  # the first step of a full read: changes after it come next
                full, gen = True, int(reply[1])
            collected += entries
            if nxt == "0":
                cache.apply_specs(collected, full=True)
                cache.spec_gen = gen
                if cache.specs_behind:
                    since, cursor, full, collected = gen, "", False, []
                    continue
                return
            cursor = nxt

    async def snapshot(self) -> Snapshot:
        """The pool's pressure at the current Redis time, exactly as selection sees it."""
        if not self._degraded:
            with suppress(CoordinationUnavailableError):
                await self.refresh()
        return self._current_snapshot()

    async def alive_ids(self) -> set[str]:
        """Ids of the instances alive as `snapshot()` rows have them, without building
        the rows (60-90 ms of the event loop at 10,000 instances): /healthz asks on
        every probe. On the view a decision would take (re-read once it is
        `snapshot_max_age_ms` old): liveness is only re-read every `live_refresh_ms`,
        and a whole read per probe cost a read of the pool's state (270 KB at 10,000)."""
        if not self._degraded:
            with suppress(CoordinationUnavailableError):
                await self._ensure_view()
        if self._degraded:
            return {iid for iid in self._cache.rows if iid in self._alive_when_degraded}
        return self._alive_in_view()

    def _alive_in_view(self) -> set[str]:
        """Instances whose last heartbeat in this node's view is within the TTL."""
        now, ttl = self._cache.estimated_now_ms(), self.settings.instance_ttl_ms
        return {iid for iid, row in self._cache.rows.items() if now - row.last_seen_ms <= ttl}

    def _current_snapshot(self) -> Snapshot:
        """Score inputs from the cache (degraded: local counters, no predicted layer)."""
        s = self.settings
        if not self._degraded:
            now = self._cache.estimated_now_ms()
            rows = [
                instance_load(r, now, instance_ttl_ms=s.instance_ttl_ms, hint_ttl_ms=s.hint_ttl_ms)
                for r in self._cache.rows.values()
            ]
            return Snapshot(now, self._cache.spec_gen, rows, "ok")
        now = self._cache.estimated_now_ms()
        counts: dict[str, list[int]] = {}
        for res in self._local.values():
            c = counts.setdefault(res.instance_id, [0, 0, 0])
            c[0] += 1
            c[1 if res.phase == "prefill" else 2] += 1
        rows = []
        for row in self._cache.rows.values():
            c = counts.get(row.id, [0, 0, 0])
            # No hints: what the engines reported before Redis went is frozen (no node
            # stores new ones without it), and an engine that looked idle then would
            # draw every node's requests for the hints' TTL.
            local = replace(row, inflight=c[0], pending_prefill=c[1], active_decode=c[2], hints={})
            load = instance_load(
                local,
                now,
                instance_ttl_ms=s.instance_ttl_ms,
                hint_ttl_ms=s.hint_ttl_ms,
                predicted=False,
            )
            rows.append(replace(load, alive=row.id in self._alive_when_degraded))
        return Snapshot(now, self._cache.spec_gen, rows, "degraded")

    def rank(
        self,
        snap: Snapshot,
        strategy: str | None = None,
        exclude: Collection[str] = (),
        request: RequestShape | None = None,
        *,
        preview: bool = False,
    ) -> Ranking:
        """Rank a snapshot's eligible rows with a strategy (default: the settings').

        A decision's ranking advances the node's tie rotation (and power_of_two's
        random draws). With `preview` it ranks on copies of them instead: the ranking
        the node's next decision would make on this snapshot, for views such as
        /debug/instance_loads that must not steer routing by being read. A preview
        only reads the node's state, so it may run in a worker thread.
        """
        name = strategy or self.settings.strategy
        if name not in STRATEGIES:
            raise InvalidArgumentError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
        rows = [r for r in eligible(snap.rows) if r.id not in exclude]
        rr, rng = self._rr, self._rng
        if preview:
            rr, rng = replace(rr), random.Random()
            rng.setstate(self._rng.getstate())
        # Degraded, the node ranks on its own counts: ties take turns (RoundRobin).
        rr.turns = snap.coordination == "degraded"
        return rank(name, rows, self.settings.weights, rr, rng, request)

    # ------------------------------------------------------------------ reservations

    async def reserve(
        self,
        prompt_tokens: int,
        expected_output_tokens: int,
        strategy: str | None = None,
        *,
        rid: str | None = None,
        exclude: Collection[str] = (),
        cached_tokens: Mapping[str, int] | None = None,
    ) -> Reservation:
        """Choose an instance and record the request on it (see DESIGN.md §4).

        `exclude` names instances not to choose (e.g. one that just refused a connection).
        `cached_tokens` maps instance ids to the prompt tokens expected in their prefix
        cache: ranking and the predicted prefill count only the uncached rest.
        """
        for name, value in (
            ("prompt_tokens", prompt_tokens),
            ("expected_output_tokens", expected_output_tokens),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOKENS
            ):
                raise InvalidArgumentError(
                    f"{name} must be an integer in 0..{MAX_TOKENS}, got {value!r}"
                )
        if rid is None:
            rid = os.urandom(16).hex()  # 128 random bits, as uuid4 without its object
        elif not ID_RE.fullmatch(rid):
            raise InvalidArgumentError(f"rid {rid!r} must match {ID_RE.pattern}")
        if strategy is not None and strategy not in STRATEGIES:
            raise InvalidArgumentError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
        request = RequestShape(
            prompt_tokens, expected_output_tokens, _checked_cached(cached_tokens or {})
        )
        skip = frozenset(exclude)
        deadline = time.monotonic() + self.settings.queue_timeout_ms / 1000
        while True:
            try:
                return await self._reserve_shared(rid, request, strategy, skip)
            except CoordinationUnavailableError:
                hold = self._restoring_tail
                if hold is None:
                    return self._reserve_local(rid, request, strategy, skip)
                # Re-assertion is restoring its last few reservations: one more local
                # one would keep it chasing them. Wait (a few calls), then decide again.
                await hold.wait()
            except PoolFullError as full:
                remaining = deadline - time.monotonic()
                if self.settings.full_policy == "reject" or remaining <= 0:
                    raise
                wait = min(max(full.retry_after_ms, 5) / 1000, 0.05, remaining)
                self.stats.queue_waiting += 1
                try:
                    await asyncio.sleep(wait)
                finally:
                    self.stats.queue_waiting -= 1

    async def _reserve_shared(
        self, rid: str, request: RequestShape, strategy: str | None, skip: frozenset[str]
    ) -> Reservation:
        async with self._decide:
            return await self._decide_and_reserve(rid, request, strategy, skip)

    async def _decide_and_reserve(
        self, rid: str, request: RequestShape, strategy: str | None, skip: frozenset[str]
    ) -> Reservation:
        s = self.settings
        prompt, expected = request.prompt_tokens, request.expected_output_tokens
        if self._degraded:
            raise CoordinationUnavailableError("coordination is degraded")
        refreshed = await self._ensure_view()
        ranked_as = self._guard_hot_spots(request)
        for attempt in range(s.reserve_retries + 1):
            candidates, ties, scores = self._candidates(strategy, skip, ranked_as)
            if not candidates and not refreshed:
                # A young cache may predate a registration: look again before a 503.
                await self.refresh()
                refreshed = True
                candidates, ties, scores = self._candidates(strategy, skip, ranked_as)
            if not candidates:
                raise NoInstanceError("no alive instance in pool " + self.pool)
            candidates = self._slot_ordered(candidates, ties)
            # With one candidate there is nothing to spread over: no point retrying.
            force = attempt == s.reserve_retries or len(candidates) == 1
            args: list[Any] = [
                rid,
                self.node_id,
                prompt,
                expected,
                int(force),
                int(s.enforce_max_slots),
                s.instance_ttl_ms,
                0 if self._leased else s.lease_ms,
                self._cache.reserve_token(LEAN_STATE_BYTES),
                len(candidates),
                ties,
                self._cache.slots_token,
            ]
            rows = [self._cache.rows[iid] for iid in candidates]
            cached = bool(request.cached_tokens)
            prefills = [
                row.spec.prefill_ms(request.uncached_on(row.id) if cached else prompt)
                for row in rows
            ]
            bounds = guard_bounds(
                rows,
                ranked_as,
                s.weights,
                self._cache.estimated_now_ms(),
                # The guard works on the faded credit (ranked_as): the same prefills
                # only when there is no credit at all.
                None if cached else prefills,
                ties,
            )
            entries = self._cache.entries
            for row, prefill, (max_inflight, max_pending, max_free_at) in zip(
                rows, prefills, bounds, strict=True
            ):
                entry = entries.get(row.id)
                args += [
                    row.id,
                    pack_candidate(
                        entry.slot if entry else NO_SLOT,
                        prefill,
                        row.spec.decode_ms(expected),
                        max_inflight,
                        max_pending,
                        max_free_at,
                    ),
                ]
            carried = self._take_carried(rid)
            records = self._records.take()
            if self._carry or self._records:
                self._schedule_carry()  # the rest go in carry calls of their own
            args += self._carried_args(carried, records)
            issued = self._cache.state_ver  # the version view_token named
            try:
                reply = await self._call("reserve", args, self._carry_keys(records))
            except BaseException as exc:
                self._carry[:0] = carried  # not known to have arrived: send them again
                if carried:
                    self._schedule_carry()
                failed(records, exc)  # not known to be recorded: the index is approximate
                raise
            status = str(reply[0])
            current = self._apply(reply[-1], issued, self._settle(reply[-2], carried, records))
            if status in ("ok", "dup"):
                self._leased = True
                if force:
                    self.stats.forced_reserves += 1
                if current and self._cache.specs_behind:
                    # A spec changed meanwhile (a restart on another address, say): the
                    # reservation must go to the URL Redis has now, not the cached one.
                    with suppress(CoordinationUnavailableError):
                        await self._read_specs(self._call)
                return self._record(rid, reply, request, scores, rows)
            if status == "nolease":
                # Peers may have reaped this node: re-assert before writing again.
                self.stats.lease_losses += 1
                self._enter_degraded("lease expired: re-asserting reservations")
                raise CoordinationUnavailableError("lease expired")
            if not current:
                raise CoordinationUnavailableError("redis lost the pool: re-asserting")
            if self._cache.specs_behind:
                # Instances came or went since the view was read (every candidate may
                # be gone): rank again on the instances Redis has now.
                await self._read_specs(self._call)
            if status == "full":
                # The reply's view may show room the ranking missed: rank again.
                if attempt == s.reserve_retries or not self._room_left(skip):
                    raise PoolFullError(int(reply[1]))
            self.stats.reserve_retries += 1
        raise NoInstanceError("no alive instance accepted the reservation")

    def _slot_ordered(self, candidates: list[str], ties: int) -> list[str]:
        """The candidates with the tied ones in their slots' order, as the script
        walks them round the pool (lua/reserve.lua ARGV[11]): it then sorts nothing."""
        if ties < 2:
            return candidates
        entries = self._cache.entries

        def slot(iid: str) -> int:
            entry = entries.get(iid)
            return entry.slot if entry else -1

        return sorted(candidates[:ties], key=slot) + candidates[ties:]

    def _guard_hot_spots(self, request: RequestShape) -> RequestShape:
        """The request as ranking sees it: cache credit faded on instances much busier
        than the idlest (coordinator/prefix.py); the reservation keeps the full credit,
        since the engine's cache does not care why the request came."""
        guard_ms = self.settings.prefix_guard_ms
        if not request.cached_tokens or guard_ms <= 0:
            return request
        floor, backlogs = self._columns_view.backlogs(
            self._cache,
            self._cache.estimated_now_ms(),
            self.settings.instance_ttl_ms,
            request.cached_tokens,
        )
        if floor is None:
            return request
        room = None
        if getattr(request.cached_tokens, "hot", None):
            inflight, started = self._columns_view.bounded_loads(
                self._cache, self._cache.estimated_now_ms(), self.settings.instance_ttl_ms
            )
            recent = self.prefix.starts.counts(started, time.monotonic() * 1000)
            room = idle_fleet_room(inflight, recent, self.settings.prefix_hot_load_pct)
        cached = guarded_cached_tokens(
            request.cached_tokens,
            backlogs.get,
            floor,
            guard_ms,
            self.settings.prefix_hot_guard_ms,
            room,
            cheap_copy_tokens(self.settings.prefix_cache_tokens),
        )
        return replace(request, cached_tokens=cached)

    def _candidates(
        self, strategy: str | None, skip: frozenset[str], request: RequestShape
    ) -> tuple[list[str], int, Mapping[str, Score]]:
        """The top_k candidates for reserve, how many lead tied, and the scores: a
        hot prefix's crowded instances last (coordinator/strategies.py crowded_last)."""
        crowded: frozenset[str] = getattr(request.cached_tokens, "crowded", frozenset())
        return crowded_last(
            lambda out: self._rank_for_reserve(strategy, skip | out, request),
            crowded,
            self.settings.top_k,
        )

    def _rank_for_reserve(
        self, strategy: str | None, skip: frozenset[str], request: RequestShape
    ) -> Ranking:
        """least_load through the vectorized ranker; other strategies on full rows.

        With enforce_max_slots, full instances are ranked out first: the script sees
        only the top k, and k full ones would refuse while another has room. When
        every instance is full they are ranked anyway, so the script answers `full`
        with the wait until the earliest slot frees up.
        """
        if self.settings.enforce_max_slots:
            ranking = self._rank_candidates(strategy, skip, request, room_only=True)
            if ranking.ranked:
                return ranking
        return self._rank_candidates(strategy, skip, request, room_only=False)

    def _rank_candidates(
        self,
        strategy: str | None,
        skip: frozenset[str],
        request: RequestShape,
        *,
        room_only: bool,
    ) -> Ranking:
        name = strategy or self.settings.strategy
        if name != "least_load" or skip:
            if room_only:
                skip = skip | self._full_ids()
            return self.rank(self._current_snapshot(), name, exclude=skip, request=request)
        s = self.settings
        return self._columns_view.rank_least_load(
            self._cache,
            self._cache.estimated_now_ms(),
            s.weights,
            self._rr,
            instance_ttl_ms=s.instance_ttl_ms,
            hint_ttl_ms=s.hint_ttl_ms,
            k=s.top_k,
            room_only=room_only,
            request=request,
            sample=s.stale_sample if self._cache.missed_changes >= len(self._cache.rows) else 0,
            rng=self._np_rng,
        )

    def _full_ids(self) -> frozenset[str]:
        """Instances at max_slots in the cache."""
        return frozenset(
            iid for iid, r in self._cache.rows.items() if 0 < r.max_slots <= r.inflight
        )

    def _room_left(self, skip: frozenset[str]) -> bool:
        """Whether the cache shows an alive, selectable instance below max_slots."""
        snap = self._current_snapshot()
        return any(
            r.id not in skip and (r.max_slots <= 0 or (r.inflight or 0) < r.max_slots)
            for r in eligible(snap.rows)
        )

    def _record(
        self,
        rid: str,
        reply: list[Any],
        request: RequestShape,
        scores: Mapping[str, Score],
        ranked: Sequence[InstanceRow],
    ) -> Reservation:
        prompt, expected = request.prompt_tokens, request.expected_output_tokens
        iid, epoch = str(reply[1]), int(reply[2])
        ttft = None if reply[3] is None else int(reply[3])
        prefill_ms, decode_ms = int(reply[4]), int(reply[5])
        # The view read after the reply may have lost the row (its spec left Redis
        # meanwhile: a key evicted, say): the candidate's row it was ranked on has the URL.
        row = self._cache.rows.get(iid) or next((r for r in ranked if r.id == iid), None)
        url = row.spec.url if row else ""
        known = self._local.get(rid)
        if known is None or (known.instance_id, known.epoch) != (iid, epoch):
            # A new claim, or one Redis made where this node's entry is stale (its
            # epoch was voided): Redis' record is where the reservation is counted.
            # A duplicate of the claim this node knows keeps the phase it knows.
            phase = known.phase if known is not None and str(reply[0]) == "dup" else "prefill"
            self._local[rid] = LocalReservation(
                rid, iid, epoch, phase, prompt, expected, prefill_ms, decode_ms, in_redis=True
            )
        timed = row is not None and row.spec.has_timing
        # The reply's view already counts this reservation.
        alone = row is not None and row.pending_prefill == 1 and row.epoch == epoch
        return Reservation(
            rid,
            iid,
            url,
            epoch,
            ttft if timed else None,
            prefill_ms,
            decode_ms,
            prompt,
            expected,
            False,
            scores,
            request.cached_on(iid),
            alone,
            row.inflight if row is not None else 0,
        )

    def _reserve_local(
        self, rid: str, request: RequestShape, strategy: str | None, skip: frozenset[str]
    ) -> Reservation:
        """Degraded mode: the same strategy over this node's own counters."""
        prompt, expected = request.prompt_tokens, request.expected_output_tokens
        existing = self._local.get(rid)
        snap = self._current_snapshot()
        ranking = self.rank(snap, strategy, exclude=skip, request=request)
        chosen = ranking.choice
        if existing is not None:
            row = self._cache.rows.get(existing.instance_id)
            return Reservation(
                rid,
                existing.instance_id,
                row.spec.url if row else "",
                existing.epoch,
                None,
                existing.prefill_ms,
                existing.decode_ms,
                prompt,
                expected,
                True,
                None,
                request.cached_on(existing.instance_id),
            )
        if chosen is None:
            raise NoInstanceError("no alive instance known to this node (degraded)")
        prefill_ms = chosen.spec.prefill_ms(request.uncached_on(chosen.id))
        decode_ms = chosen.spec.decode_ms(expected)
        self._local[rid] = LocalReservation(
            rid,
            chosen.id,
            chosen.epoch,
            "prefill",
            prompt,
            expected,
            prefill_ms,
            decode_ms,
            in_redis=False,
        )
        return Reservation(
            rid,
            chosen.id,
            chosen.url,
            chosen.epoch,
            None,
            prefill_ms,
            decode_ms,
            prompt,
            expected,
            True,
            ranking.scores,
            request.cached_on(chosen.id),
        )

    async def mark_first_token(self, rid: str) -> bool:
        """Move a reservation to decode; False when it was unknown or already there."""
        return await self._send_first_token(rid, self._mark_locally(rid))

    async def release(self, rid: str) -> bool:
        """End a reservation; a second release (or an unknown rid) changes nothing."""
        return await self._send_release(rid, self._release_locally(rid))

    def first_token_soon(self, rid: str) -> None:
        """mark_first_token without waiting: it rides on this node's next reserve, or
        goes by itself after `carry_ms` (what the proxy calls)."""
        self._hold("f", rid, self._mark_locally(rid))

    def release_soon(self, rid: str) -> None:
        """release without waiting: it rides on this node's next reserve, or goes by
        itself after `carry_ms` (what the proxy calls)."""
        self._hold("r", rid, self._release_locally(rid))

    async def flush_carried(self) -> None:
        """Send every held mark, release and prefix record now, in calls of at most
        CARRY_STEP transitions and RECORD_STEP records."""
        while self._carry or self._records:
            held = self._take_carried()
            records = self._records.take()
            self.stats.carry_calls += 1
            try:
                reply = await self._call(
                    "carry", self._carried_args(held, records), self._carry_keys(records)
                )
            except CoordinationUnavailableError as exc:
                for op, rid, res in held:  # as release() does when Redis is away
                    if op == "r" and (res is None or res.in_redis):
                        self._pending_releases.add(rid)
                failed(records, exc)
                continue
            except BaseException as exc:  # refused for a reason of its own
                failed(records, exc)
                if not isinstance(exc, Exception):
                    raise
                log.exception(
                    "sending %d held marks and releases, %d records failed: "
                    "sending the marks and releases one by one",
                    len(held),
                    len(records),
                )
                await self._send_one_by_one(held)
                continue
            self._apply_carried(self._settle(reply, held, records))

    async def _send_one_by_one(
        self, held: Sequence[tuple[str, str, LocalReservation | None]]
    ) -> None:
        """Held transitions whose carry call Redis refused for a reason of its own (a
        record it rejects, a hand-edited key): each goes in a call of its own, so one
        that fails again takes no other with it. Sending one twice changes nothing: a
        script that failed part-way may have applied it already."""
        for op, rid, res in held:
            try:
                if op == "r":
                    await self._send_release(rid, res)
                else:
                    await self._send_first_token(rid, res)
            except Exception:
                kind = "release" if op == "r" else "first-token mark"
                log.exception("the %s of reservation %s failed: dropped", kind, rid)

    def hold_record(self, stem: str, max_owners: int, pairs: Sequence[Any]) -> Awaitable[int]:
        """Hold a prefix record (PrefixIndex.record) for this node's next reserve, or a
        carry call after `carry_ms`; the result is the instance's count after it."""
        if self._degraded:
            raise CoordinationUnavailableError("coordination is degraded")
        count = self._records.hold(stem, max_owners, pairs)
        self._schedule_carry()
        return count

    @staticmethod
    def _carried_args(
        held: Sequence[tuple[str, str, LocalReservation | None]], records: Sequence[Any]
    ) -> list[Any]:
        """The arguments a reserve or carry call ends with: the held transitions, then
        the records (lua/_lib.lua carried_count)."""
        args: list[Any] = [len(held)]
        for op, rid, _ in held:
            args += [op, rid]
        return args + record_args(records)

    def _carry_keys(self, records: Sequence[Any]) -> tuple[bytes, ...]:
        """The keys a reserve or carry call takes after the pool's."""
        return (self._node_rids, self._prefix_key) if records else (self._node_rids,)

    @staticmethod
    def _settle(replies: Sequence[Any], carried: Sequence[Any], records: Sequence[Any]) -> Any:
        """The carried transitions' replies; the records' counts after them go to their
        holders."""
        cut = 4 * len(carried)
        settled(records, replies[cut:])
        return replies[:cut]

    def _take_carried(
        self, rid: str | None = None
    ) -> list[tuple[str, str, LocalReservation | None]]:
        """Up to CARRY_STEP held transitions for one call, oldest first, always with
        those of `rid` (a reserve's own rid: a retry under it must carry the release
        that ends the first attempt). What stays held keeps its order; each rid's
        transitions are taken as a prefix of them, so none overtakes an earlier one."""
        if len(self._carry) <= CARRY_STEP:
            taken, self._carry = self._carry, []
            return taken
        room = CARRY_STEP - sum(1 for _, held, _ in self._carry if held == rid)
        taken, kept = [], []
        for item in self._carry:
            if item[1] == rid:
                taken.append(item)
            elif room > 0:
                taken.append(item)
                room -= 1
            else:
                kept.append(item)
        self._carry = kept
        return taken

    def _apply_carried(self, replies: Sequence[Any]) -> None:
        """The changes of `state` carried transitions made, into the view."""
        for k in range(0, len(replies), 4):
            if int(replies[k + 1]) >= 0:
                self._cache.apply_patch(replies[k + 1], replies[k + 2], replies[k + 3])

    def _hold(self, op: str, rid: str, res: LocalReservation | None) -> None:
        if op == "r" and self._degraded:
            self._send_release_later(rid, res)
            return
        self._carry.append((op, rid, res))
        self._schedule_carry()

    def _schedule_carry(self) -> None:
        if self._carry_flush is None or self._carry_flush.done():
            self._carry_flush = asyncio.create_task(
                self._flush_carried_after(self.settings.carry_ms / 1000),
                name="coordinator-carry",
            )

    async def _flush_carried_after(self, delay_s: float) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        await self.flush_carried()

    def _mark_locally(self, rid: str) -> LocalReservation | None:
        res = self._local.get(_checked_rid(rid))
        if res is not None:
            res.phase = "decode"
        return res

    def _release_locally(self, rid: str) -> LocalReservation | None:
        return self._local.pop(_checked_rid(rid), None)

    async def _send_first_token(self, rid: str, res: LocalReservation | None) -> bool:
        try:
            reply = await self._call("mark_first_token", [rid])
        except CoordinationUnavailableError:
            return res is not None
        return self._applied(reply)

    async def _send_release(self, rid: str, res: LocalReservation | None) -> bool:
        if self._degraded:
            return self._send_release_later(rid, res)
        try:
            reply = await self._call("release", [rid], (self._node_rids,))
        except CoordinationUnavailableError:
            if res is None or res.in_redis:
                self._pending_releases.add(rid)
            return res is not None
        return self._applied(reply)

    def _send_release_later(self, rid: str, res: LocalReservation | None) -> bool:
        """Degraded: the re-assert releases it (even a reservation made while degraded:
        a re-assert may be restoring it right now, and releasing an unknown rid is a
        no-op anyway)."""
        if res is not None:
            self._pending_releases.add(rid)
        return res is not None

    def _applied(self, reply: list[Any]) -> bool:
        """Whether a transition happened; its change of `state` goes into the view."""
        if len(reply) == 4:
            self._cache.apply_patch(reply[1], reply[2], reply[3])
        return as_text(reply[0]) == "ok"

    # ------------------------------------------------------------------ leases

    async def renew_lease(self) -> list[str]:
        """Extend this node's lease; returns the ids of nodes whose lease expired.

        A lease found expired or missing, after this node held one, means peers may
        have reaped its reservations (a stall beyond the lease, or Redis lost the
        pool): the node re-asserts them, through degraded mode as after an outage.
        The same call runs the pool's audit step when one is due, and counts this
        node's rids set; either finding damage makes the node re-assert too.
        """
        held = sum(1 for res in self._local.values() if res.in_redis)
        reply = await self._call("renew_lease", *self._renew_args(audit=True))
        if found := as_text(reply[6]):
            self._leased = False  # the lease went with the pool's keys: no stall
            self._audit_failed(found)
        elif as_text(reply[0]) == "ok" and 0 <= int(reply[7]) < held:
            # Every reservation this node holds in Redis is in its rids set (a release
            # leaves the set after the node forgot it): fewer means the set was lost
            # or edited, and the reaper could not release them when this node dies.
            self._enter_degraded(
                f"this node's rids set holds {reply[7]} ids for its {held} reservations "
                "in Redis (lost or edited): re-asserting them"
            )
        if orphans := int(reply[8]):
            self.stats.orphans_released += orphans
            log.warning(
                "pool %s: released %d reservations whose node holds no lease (its rids "
                "set or the nodes key was lost or edited before the reaper came)",
                self.pool,
                orphans,
            )
        self._lease_renewed(reply)
        self._voids_left = int(reply[4])
        return [str(n) for n in reply[3] if str(n) != self.node_id]

    def _renew_args(self, audit: bool = False) -> tuple[list[Any], tuple[str, bytes]]:
        """renew_lease's arguments; with `audit`, it also runs the pool's audit step
        when one is due (never in a re-assert: a reset would undo what it restored)."""
        period = self.settings.audit_interval_ms if audit else 0
        return (
            [self.node_id, self.settings.lease_ms, self._incarnation, period, AUDIT_STEP],
            (self.keys.node_owner(self.node_id), self._node_rids),
        )

    def _audit_failed(self, found: str) -> None:
        """The audit found the pool's keys disagreeing (`found` says how) and deleted
        them: this node re-asserts at once, the others when their next call meets the
        new run_id or their lease is gone."""
        self.stats.audit_resets += 1
        log.error(
            "pool %s: its keys disagreed (%s): a key was lost (eviction: set "
            "maxmemory-policy noeviction) or edited by hand; cleared the pool, every node "
            "re-asserts what it holds",
            self.pool,
            found,
        )
        self._enter_degraded("the audit cleared the pool: re-asserting")

    @property
    def node_id_shared(self) -> bool:
        """Whether another process renewed this node id's lease within the last three
        leases: two processes run under one id (see _check_owner)."""
        return (
            self._shared_mono is not None
            and time.monotonic() - self._shared_mono < 3 * self.settings.lease_ms / 1000
        )

    def _check_owner(self, previous: str) -> None:
        """Another process renewed this node's lease since this one did: two processes
        share the node id. Each one's start-up and re-asserts then release what the
        other holds, so the pool undercounts its requests until one gets its own id."""
        if not (self._renewed_own and previous and previous != self._incarnation):
            self._renewed_own = True
            return
        self.stats.node_id_conflicts += 1
        now = time.monotonic()
        self._shared_mono = now
        said = self._shared_said_mono
        if said is None or now - said >= NODE_ID_CONFLICT_LOG_S:
            self._shared_said_mono = now
            log.error(
                "node id %r is in use by another process too (it renewed this node's "
                "lease after this process did): give every node its own id "
                "(--node-id, COORD_NODE_ID); until then each one's start-up and "
                "re-asserts release the other's reservations",
                self.node_id,
            )

    def _lease_renewed(self, reply: list[Any]) -> None:
        self._check_owner(as_text(reply[5]))
        status = as_text(reply[0])
        lost = status != "ok" and self._leased
        self._leased = True
        self._renewed_mono = time.monotonic()
        if not lost:
            return
        self.stats.lease_losses += 1
        if self._reasserting:
            self._lease_lost = True
        elif self._local or self._pending_releases:
            self._enter_degraded(f"lease {status}: re-asserting reservations")

    async def reap_node(self, node_id: str, *, force: bool = False) -> int:
        """Release every reservation of an expired node; 0 if it came back meanwhile.

        `force` skips the lease check: only for this node's own id at start-up.
        """
        reaped = 0
        while True:
            reply = await self._call(
                "reap_node", [node_id, int(force), REAP_STEP], (self.keys.node_rids(node_id),)
            )
            reaped += int(reply[1])
            if str(reply[0]) != "more":
                break
        if reaped:
            self.stats.reaped += reaped
            log.info("reaped %d reservations of expired node %s", reaped, node_id)
            if self.on_reaped is not None:
                self.on_reaped(reaped)
        return reaped

    async def retire(self) -> int:
        """Leave the pool cleanly: release what this node still holds, drop its lease.

        For a node that has drained (a clean shutdown): peers then need not wait a
        lease to reap it. Returns the reservations released. Not for a node that may
        go on serving; with Redis away it does nothing (the lease then expires).
        """
        self._local.clear()
        self._pending_releases.clear()
        self._carry.clear()  # what they would release, the reap below releases
        self._records.drop(CoordinationUnavailableError("the node left the pool"))
        with suppress(CoordinationUnavailableError):
            return await self.reap_node(self.node_id, force=True)
        return 0

    async def reap_expired(self) -> int:
        """Renew this node's lease, reap every expired node, sweep void records.

        Returns the reservations reaped. Sweeping (records of restarted or removed
        instances) runs one bounded step per call, so a big pool never stalls Redis.
        """
        total = 0
        for node in await self.renew_lease():
            total += await self.reap_node(node)
        if self._voids_left:
            self._voids_left = int((await self._call("sweep", [SWEEP_STEP]))[1])
        return total

    async def _lease_loop(self) -> None:
        period = self.settings.lease_ms / 3000
        while True:
            if not self._degraded:
                try:
                    await self.reap_expired()
                except CoordinationUnavailableError:
                    pass
                except Exception:
                    log.exception("lease renewal failed")
            elif self._reasserting:
                # A long re-assert must not outlive the lease it writes under.
                with suppress(*UNAVAILABLE, CoordinationUnavailableError):
                    await self._renew_directly()
            raise_if_cancelling()
            await asyncio.sleep(period)

    async def _renew_directly(self) -> None:
        reply = await self._direct_call("renew_lease", *self._renew_args())
        self._lease_renewed(reply)

    # ------------------------------------------------------------------ degraded mode

    async def _recover(self) -> None:
        """Probe Redis until it answers, then re-assert lease, registrations, reservations."""
        interval = self.settings.recovery_interval_ms / 1000
        while True:
            raise_if_cancelling()
            await asyncio.sleep(interval)
            try:
                await self._reassert()
            except (*UNAVAILABLE, CoordinationUnavailableError) as exc:
                log.debug("redis still unavailable: %s", exc)
                continue
            except Exception:
                log.exception("re-asserting state failed; will retry")
                continue
            log.warning("coordination ok: state re-asserted")
            return

    async def _reassert(self) -> None:
        """Idempotently restore this node's state, then leave degraded mode."""
        self._reasserting = True
        try:
            await self._reassert_all()
            # No await between the last check in _reassert_all and this switch:
            # nothing can slip by.
            self._degraded = False
            if self._identity is not None:  # the server it re-asserted to, its calls
                self._server_changes = self._identity.changes  # reached (and repaired)
        finally:
            self._reasserting = False
            hold, self._restoring_tail = self._restoring_tail, None
            if hold is not None:
                hold.set()  # held reservations decide again: through Redis, or locally

    async def _reassert_all(self) -> None:
        direct = self._direct_call
        # The specs this node last saw, before a snapshot of an emptied Redis drops them.
        known = {iid: (e.spec, e.epoch) for iid, e in self._cache.entries.items()}
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:  # connections from before a restart are dead: drop them all
            await pool.disconnect()
        self._lease_lost = False
        await self._renew_directly()
        self._lease_lost = False
        for spec in list(self._registered.values()):
            with suppress(EpochFencedError):
                await direct("register", [spec.id, spec.to_json(), spec.max_slots, spec.epoch])
        # Read the pool into a new view and switch at once: degraded selection keeps
        # using the old rows until then (the reads in between may take many steps).
        fresh = self._new_cache()
        fresh.apply_learned(self._cache.learned)
        fresh.apply_view(*(await direct("read_state", [1]))[:READ_STATE_VIEW])
        if fresh.specs_behind:
            await self._read_specs(direct, fresh)
        self._cache.take(fresh)
        # Renew between chunks: restoring thousands of reservations over a slow link
        # can take longer than the lease, and a peer would reap them meanwhile.
        renew_every = self.settings.lease_ms / 3000
        done: set[str] = set()
        reconciled = False
        while True:
            if self._lease_lost:
                # The lease ran out mid-way: what was restored may be reaped. Start over.
                self._lease_lost = False
                await self._renew_directly()
                done.clear()
            todo = [r for rid, r in self._local.items() if rid not in done]
            releases = list(self._pending_releases)
            if not todo and not releases:
                if reconciled:
                    break
                # Redis may hold reservations this node already released (a release
                # the failed-over server never replicated): release those too.
                held = await self.redis.smembers(self._node_rids)
                self._pending_releases.update(
                    rid for rid in map(str, held) if rid not in self._local
                )
                reconciled = True
                continue
            for res in todo:
                if self._lease_lost:
                    break
                if time.monotonic() - self._renewed_mono > renew_every:
                    await self._renew_directly()
                    if self._lease_lost:
                        break
                done.add(res.rid)
                if res.rid not in self._local:  # released before its turn came
                    continue
                await self._restore_one(res, known, done)
            for rid in releases:
                await direct("release", [rid], (self._node_rids,))
                self._pending_releases.discard(rid)
            if self._restoring_tail is None:
                # The first pass is done: what came meanwhile is restored next, while
                # new requests wait, so this loop ends (a node serving requests faster
                # than it restores them would otherwise chase them for seconds).
                self._restoring_tail = asyncio.Event()

    async def _restore_one(
        self,
        res: LocalReservation,
        known: dict[str, tuple[InstanceSpec, int]],
        done: set[str],
    ) -> None:
        """Re-assert one reservation; one that cannot be restored never blocks the rest."""
        try:
            reply = await self._direct_call(
                "restore",
                [
                    res.rid,
                    self.node_id,
                    res.instance_id,
                    res.epoch,
                    res.phase,
                    res.prompt_tokens,
                    res.expected_output_tokens,
                    min(res.prefill_ms, MAX_PREDICTED_MS),
                    min(res.decode_ms, MAX_PREDICTED_MS),
                ],
                (self._node_rids,),
            )
        except ScriptArgumentError as exc:
            # Nothing was written; keep serving the request, uncounted, rather than
            # stay degraded until it ends.
            log.error("cannot re-assert reservation %s (%s): left uncounted", res.rid, exc)
            self.stats.unrestorable += 1
            self._local.pop(res.rid, None)
            return
        status = str(reply[0])
        if status == "nolease":
            self._lease_lost = True
            done.discard(res.rid)
            return
        if status == "unknown" and res.instance_id in known:
            # Redis lost the instance and its registrar has not re-registered
            # it yet: re-register what this node knew, then restore again.
            spec, epoch = known.pop(res.instance_id)
            with suppress(EpochFencedError):
                await self._direct_call(
                    "register", [spec.id, spec.to_json(), spec.max_slots, epoch]
                )
            done.discard(res.rid)
            return
        if status in ("void", "unknown"):
            self._local.pop(res.rid, None)
            return
        local = self._local.get(res.rid)
        if local is None:  # released while the restore was in flight: it is in Redis now
            self._pending_releases.add(res.rid)
            return
        local.in_redis = True
        # Redis already held the rid (a reserve whose reply was lost): its record,
        # not this node's guess, says where the reservation is counted.
        local.instance_id, local.epoch = str(reply[1]), int(reply[2])

    # ------------------------------------------------------------------ passive health

    async def record_outcome(
        self,
        instance_id: str,
        ok: bool,
        policy: OutlierPolicy,
        reason: str = "",
        rate: bool = False,
    ) -> Outcome:
        """Count one exchange with an instance, fleet-wide; may eject it (record_outcome.lua).
        `rate`: a failure that ejects whatever the count (this node's share of failed
        exchanges with the instance reached the policy's: outliers.FailureShares)."""
        outcome = "ok" if ok else ("rate" if rate else "fail")
        return await self._record_outcome(instance_id, outcome, policy, reason)

    async def _record_outcome(
        self, instance_id: str, outcome: str, policy: OutlierPolicy, reason: str
    ) -> Outcome:
        if not isinstance(instance_id, str) or not ID_RE.match(instance_id):
            raise InvalidArgumentError(f"instance id {instance_id!r} is not a valid id")
        reply = await self._call(
            "record_outcome",
            [
                instance_id,
                outcome,
                policy.consecutive_failures or CONSECUTIVE_OFF,
                policy.failure_window_ms,
                policy.base_ejection_ms,
                policy.max_ejection_ms,
                repr(float(policy.max_ejection_percent)),
                self._alive_count(),
                reason,
            ],
            (self.keys.outliers(), self.keys.ejected()),
        )
        return Outcome(str(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]))

    async def cordon(self, instance_id: str, reason: str = "", *, lift: bool = False) -> Outcome:
        """Take an instance out of rotation fleet-wide (an operator's maintenance drain):
        no node sends it new requests, the ones in flight finish; `lift` puts it back.

        A cordon holds until lifted, until the instance registers again under a new
        epoch (a restarted engine comes back in rotation), or until it is unregistered.
        Raises UnknownInstanceError for an instance that is not registered."""
        if (
            not isinstance(reason, str)
            or len(reason.encode()) > MAX_CORDON_REASON
            or not reason.isprintable()  # no line breaks or escapes for views and logs
        ):
            raise InvalidArgumentError(
                f"reason must be printable text of at most {MAX_CORDON_REASON} bytes"
            )
        # The script checks a policy's arguments; a cordon ignores them.
        action = "uncordon" if lift else "cordon"
        outcome = await self._record_outcome(instance_id, action, OutlierPolicy(), reason)
        if outcome.state == "unknown":
            raise UnknownInstanceError(f"instance {instance_id!r} is not registered")
        return outcome

    def _alive_count(self) -> int:
        """Instances alive in this node's view: the ejection cap's denominator."""
        return len(self._alive_in_view())

    async def read_outliers(self) -> OutlierView:
        """Every instance's passive-health record and the Redis time of the read (in
        pages of about 256 fields, one call each: no call grows with the pool)."""
        cursor, flat, now = "0", [], 0
        while True:
            reply = await self._call("read_outliers", [cursor], (self.keys.outliers(),))
            now = int(reply[0])
            flat += list(reply[1])
            cursor = as_text(reply[2])
            if cursor == "0":
                return parse_outliers([now, flat])

    async def store_hints(self, instance_id: str, hints: dict[str, float]) -> int:
        """Store scraped engine hints without refreshing liveness; returns the epoch."""
        values = []
        for name in HINT_NAMES:
            value = hints.get(name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= float(value) < float("inf")
            ):
                raise InvalidArgumentError(f"hint {name} must be a finite number >= 0")
            values.append("" if value is None else repr(float(value)))
        reply = await self._call("store_hints", [instance_id, *values])
        return int(reply[1])

    # ------------------------------------------------------------------ learned timing

    def observe(
        self,
        res: Reservation,
        *,
        ttft_ms: float | None = None,
        output_tokens: int | None = None,
        decode_ms: float | None = None,
        model: str | None = None,
    ) -> None:
        """Keep what one finished exchange showed, for the next merge (no Redis call).

        `ttft_ms` teaches prefill only when the request found no other prefill pending
        (`res.prefill_alone`): otherwise it includes a wait of unknown length.
        `decode_ms` is the time from the first token to the last.
        """
        row = self._cache.rows.get(res.instance_id)
        if row is None or row.epoch != res.epoch or res.degraded:
            row = None  # another epoch's speed, or no shared view: teaches no timing
        timing = row.timing if row is not None else None
        if row is not None and ttft_ms is not None and res.prefill_alone:
            learned = timing is not None and timing.prefill == "learned"
            self.observations.prefill(
                res.instance_id,
                res.epoch,
                res.prompt_tokens - res.cached_tokens,
                ttft_ms,
                float(res.prefill_ms) if learned else None,
            )
        if row is not None and decode_ms is not None and output_tokens and output_tokens >= 2:
            learned = timing is not None and timing.decode == "learned"
            self.observations.decode(
                res.instance_id,
                res.epoch,
                max(1, res.batch),
                decode_ms / (output_tokens - 1),
                row.spec.decode_ms_per_token if learned else None,
            )
        if output_tokens and output_tokens > 0:
            self.observations.output("", output_tokens)  # pool-wide, for unnamed models
            # Per model only for the model the serving instance registered: the body's
            # `model` is the client's, and each new name would be a new field in Redis.
            if model and row is not None and row.spec.model == model:
                self.observations.output(model, output_tokens)

    def expected_output_tokens(self, model: str | None, max_tokens: int | None = None) -> int:
        """The pool's learned mean output of a model, bounded by the request's max_tokens."""
        learned = expected_output(self._cache.learned, model or "")
        if learned is None and model:
            learned = expected_output(self._cache.learned, "")
        value = DEFAULT_OUTPUT_TOKENS if learned is None else max(1, round(learned))
        return min(value, max_tokens) if max_tokens is not None else value

    async def sync_timing(self) -> None:
        """Merge this node's samples into the pool's and take the pool's.

        In bounded steps: each call merges at most TIMING_STEP batches and returns one
        page (about 256) of the pool's records, so no call grows with the pool
        or with the node's traffic (issue 12's no-stall rule).
        """
        batches = list(self.observations.drain().items())
        records: dict[str, list[float]] = {}
        cursor = "0"
        while True:
            step, batches = batches[:TIMING_STEP], batches[TIMING_STEP:]
            args: list[Any] = [
                self.settings.timing_half_life_ms,
                repr(self._cache.timing_policy.floor_weight),
                TIMING_MAX_AGE_MS,
                cursor,
            ]
            for name, batch in step:
                args += [name, pack(batch)]
            reply = await self._call("merge_timing", args, (self.keys.timing(),))
            self._live_nodes = max(1, int(reply[3]))
            flat = list(reply[1])
            for k in range(0, len(flat), 2):
                record = unpack(flat[k + 1])
                if record is not None:
                    records[as_text(flat[k])] = record
            if cursor != "":
                cursor = as_text(reply[2])
                if cursor == "0":
                    cursor = ""  # the hash was read to its end: only merges remain
            if cursor == "" and not batches:
                break
        # Resolving every instance's timing takes the CPU for about 100 ms at 10,000
        # instances: in a worker thread, so that the event loop serves on meanwhile.
        cache = self._cache
        inputs = cache.timing_inputs()
        prior, timings = await asyncio.to_thread(resolve_pool, cache.timing_policy, inputs, records)
        self._cache.apply_learned(records, (inputs, prior, timings))

    def timing_flush_interval_ms(self) -> float:
        """How long the node waits between merges: timing_flush_ms while the pool has at
        most timing_flush_nodes live nodes, proportionally longer beyond (the pool takes
        at most timing_flush_nodes merges per timing_flush_ms), but never longer than
        the statistics' half-life: a merge stamps its samples with the time it runs, so
        older samples would pass for fresh ones and slow the following of a drift."""
        s = self.settings
        return flush_interval_ms(
            s.timing_flush_ms, s.timing_flush_nodes, s.timing_half_life_ms, self._live_nodes
        )

    async def _timing_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timing_flush_interval_ms() / 1000)
            try:
                await self.sync_timing()
            except CoordinationUnavailableError:
                pass  # samples are soft state: the next ones will do
            except Exception:
                raise_if_cancelling()
                log.exception("merging learned timing failed")
            raise_if_cancelling()  # redis-py may have swallowed our cancel (coordinator.tasks)

    async def _read_state(self, keys: list[Any], args: list[Any]) -> list[Any]:
        """read_state's view with `state` (and `live` when args[0] is 1) filled in by
        GETs in the same MULTI/EXEC: one atomic read, as when the script returned them,
        but the strings do not go through Lua, where a GET of 24 KB (the state of
        1,024 instances) costs the server about 15x the instructions of a direct GET
        (bench/instructions.py). The script itself takes no argument."""
        gets = read_state_gets(keys, args)
        for attempt in range(REDIRECT_RETRIES + 1):
            pipe = self.redis.pipeline(transaction=True)
            # Not pipe.evalsha: redis-py's cluster pipeline refuses that method by name.
            pipe.execute_command("EVALSHA", self.scripts["read_state"].sha, len(keys), *keys)
            for key in gets:
                pipe.get(key)
            try:
                head, *values = await pipe.execute()
                break
            except AskError:  # MOVED is one too
                # The pool's slot moved (a failover, resharding). redis-py's cluster
                # pipeline follows that only by retrying, which connect_redis turns off:
                # it has patched its slot map, so send the read again.
                if attempt == REDIRECT_RETRIES:
                    raise
        reply = list(head)
        reply[3] = values[0] or b""
        if len(gets) > 1:
            reply[4] = values[1] or b""
        return reply

    async def _evalsha(self, sha: str, keys: list[Any], args: list[Any]) -> Any:
        return await self.redis.evalsha(sha, len(keys), *keys, *args)

    async def _load_script(self, source: str) -> None:
        """SCRIPT LOAD where this pool's calls go. On Redis Cluster that is the pool's
        shard alone: redis-py loads a script on every primary, and one that is down
        would fail the reload on a healthy shard (a restart or SCRIPT FLUSH there)
        and degrade its pools until the other primary came back."""
        if self._shard is None:
            await self.redis.script_load(source)
        else:
            node = self.redis.get_node_from_key(self._shard)
            await self.redis.execute_command("SCRIPT LOAD", source, target_nodes=node)

    async def _direct_call(
        self, name: str, args: list[Any], extra: tuple[str | bytes, ...] = ()
    ) -> Any:
        """Run one script with its errors mapped (no degraded-mode bookkeeping)."""
        script = self.scripts[name]
        if name == "register":  # a new id continues above its prefix entries' epoch
            extra = (self.keys.prefix_index(),)
        keys = [*self._columns, *extra]
        run = self._read_state if name == "read_state" else script
        if self._shard is not None and name != "read_state":
            run = partial(self._evalsha, script.sha)  # reloaded below, on this shard only
        try:
            for _ in range(NOSCRIPT_RETRIES):
                try:
                    return await run(keys=keys, args=args)
                except NoScriptError:
                    # redis-py reloads once itself; a second SCRIPT FLUSH between its
                    # load and its retry lands here. Load again (no EVAL: see the ACL).
                    await self._load_script(script.script)
            return await run(keys=keys, args=args)
        except ResponseError as exc:
            mapped = from_response_error(exc)
            if mapped is not None:
                raise mapped from exc
            refused = refusal(exc)
            if refused is not None:
                raise refused from exc
            raise


__all__ = ["Coordinator", "LocalReservation", "RegisterResult", "Stats", "UnknownInstanceError"]


def _checked_rid(rid: str) -> str:
    if not isinstance(rid, str) or not ID_RE.fullmatch(rid):
        raise InvalidArgumentError(f"rid {rid!r} is not a valid id")
    return rid


def _checked_cached(cached: Mapping[str, int]) -> Mapping[str, int]:
    """Validate a cached_tokens map: instance ids to token counts in 0..MAX_TOKENS."""
    if not isinstance(cached, Mapping):
        raise InvalidArgumentError("cached_tokens must map instance ids to token counts")
    for iid, value in cached.items():
        if (
            not isinstance(iid, str)
            or isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value <= MAX_TOKENS
        ):
            raise InvalidArgumentError(
                f"cached_tokens[{iid!r}] must be an integer in 0..{MAX_TOKENS}, got {value!r}"
            )
    return cached
