"""The whole Redis key schema of a pool, in one place.

Slowly changing instance fields are stored column-wise: one hash per field, keyed by
instance id, so `redis-cli HGETALL 'lc:{pool}:epoch'` shows them at a glance. The
reservation counters every request changes live in one packed record per instance
(`state`, coordinator/packed.py), which `coordinator inspect` decodes. Every script
receives the same KEYS list (scripts never build key names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Use with fullmatch (or match: both end in \Z, which, unlike $, refuses a trailing
# newline that Redis and the scripts would not accept).
POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")

# Keys in the order every script receives them as KEYS[1..N]; lua/_lib.lua names the
# same positions. Each is a hash keyed by instance id unless noted.
COLUMNS: tuple[str, ...] = (
    "meta",  # hash: run_id, created_ms, spec_gen, state_ver (change counters), slots,
    # inflight_total (live reservations of the whole pool)
    "spec_log",  # zset: instance id -> spec_gen of its latest spec/membership change
    "spec",  # JSON InstanceSpec without epoch
    "epoch",  # engine epoch; older reservations are void
    "last_seen_ms",  # Redis time of the last register/heartbeat
    "max_slots",  # sequences the fleet forwards at once (0 = unlimited)
    "slot",  # the instance's record index in `state` and `live`
    "hints",  # "<id>:<hint>" and "<id>:<hint>_at_ms" engine hints
    "reservations",  # hash rid -> JSON reservation record
    "by_instance",  # lex zset "<id>#<epoch:010d>|<end_at_ms:015d>|<rid>"
    "nodes",  # zset node id -> lease deadline (Redis ms)
    "state",  # string: packed per-slot reservation counters (coordinator/packed.py): the
    # source of truth for them, read per decision
    "live",  # string: packed per-slot last_seen and hints, read at a bounded rate
    "free_slots",  # zset of freed slot indexes, reused lowest first
    "voids",  # set of instance ids whose void reservation records remain to be swept
    "retired",  # unregistered id -> its last epoch, while void records of it remain
)


def tagged(prefix: str, pool: str) -> str:
    """The key stem of a pool; the only place the {pool} hash tag is applied."""
    return f"{prefix}:{{{pool}}}"


@dataclass(frozen=True, slots=True)
class PoolKeys:
    """Key names of one pool."""

    prefix: str
    pool: str

    @property
    def stem(self) -> str:
        """The hash-tagged stem shared by every key of the pool."""
        return tagged(self.prefix, self.pool)

    def column(self, name: str) -> str:
        """The key of one column (see COLUMNS)."""
        return f"{self.stem}:{name}"

    @property
    def columns(self) -> list[str]:
        """All pool keys, in script KEYS order."""
        return [self.column(name) for name in COLUMNS]

    def node_rids(self, node_id: str) -> str:
        """Set of reservation ids a node holds; the reaper drains it."""
        return f"{self.stem}:node:{node_id}:rids"

    def node_owner(self, node_id: str) -> str:
        """Hash whose `incarnation` names the process that renewed a node's lease
        last; it expires with the lease (see lua/renew_lease.lua)."""
        return f"{self.stem}:node:{node_id}:owner"

    def outliers(self) -> str:
        """Hash of passive-health state, "<id>:<field>" (see lua/record_outcome.lua)."""
        return f"{self.stem}:outliers"

    def ejected(self) -> str:
        """Zset instance id -> ejected until (Redis ms): the ejected share in one ZCARD
        (see lua/record_outcome.lua)."""
        return f"{self.stem}:ejected"

    def prefix_index(self) -> str:
        """Hash of the prefix index: block hash -> "<id>#<epoch>|<position>" owners,
        "<id>#<epoch>" -> the instance's count, "<id>#" -> its latest epoch indexed,
        "#about" (see coordinator/prefix_entries.py)."""
        return f"{self.stem}:prefix_index"

    def legacy_prefix_keys(self) -> tuple[str, str]:
        """The prefix index as earlier versions kept it (an owners hash and an LRU zset):
        read by nothing, unlinked by the next sampled reclaim (coordinator/prefix_index.py)."""
        return f"{self.stem}:prefix_owners", f"{self.stem}:prefix_lru"

    def timing(self) -> str:
        """Hash of learned timing and output length (coordinator/timing.py records)."""
        return f"{self.stem}:timing"

    def pattern(self) -> str:
        """A SCAN/ACL pattern matching every key of the pool."""
        return f"{self.stem}:*"
