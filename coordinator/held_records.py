"""Prefix records a node holds for its next call to Redis.

A request's record (coordinator/prefix_index.py) rides along with the node's next
`reserve`, as held first-token marks and releases do, or goes in one `carry` call
after `carry_ms` when no reserve comes: a request with affinity then costs Redis the
calls it costs without, plus the lookup, and no call of its own. Each record's reply
is the instance's count in the index after it, which the holder's future receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Records one call carries (lua/_lib.lua MAX_RECORDS allows 16), and block entries in
# all (but the first record's, whatever its size: 512 at most): a record runs an HMGET
# and an HSET of its entries, so a burst goes in bounded calls.
RECORD_STEP = 8
RECORD_PAIRS = 512


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """One record's arguments (lua/_lib.lua carried_records: stem, max_owners, k, then
    k pairs) and the future its count goes to."""

    args: list[Any]
    count: asyncio.Future[int]


class HeldRecords:
    """The records a node holds, oldest first."""

    def __init__(self) -> None:
        self._held: list[HeldRecord] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, stem: str, max_owners: int, pairs: Sequence[Any]) -> asyncio.Future[int]:
        """Hold a record: `pairs` is the flat list of block hashes and weights."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._held.append(HeldRecord([stem, max_owners, len(pairs) // 2, *pairs], future))
        return future

    def take(self) -> list[HeldRecord]:
        """The oldest records one call carries."""
        count, pairs = 0, 0
        for record in self._held[:RECORD_STEP]:
            pairs += record.args[2]
            if count and pairs > RECORD_PAIRS:
                break
            count += 1
        taken, self._held = self._held[:count], self._held[count:]
        return taken

    def drop(self, error: BaseException) -> None:
        """Give up every held record (their holders see `error`: nothing recorded)."""
        held, self._held = self._held, []
        failed(held, error)


def record_args(records: Sequence[HeldRecord]) -> list[Any]:
    """The arguments that follow a call's carried transitions (none for no record)."""
    if not records:
        return []
    out: list[Any] = [len(records)]
    for record in records:
        out += record.args
    return out


def settled(records: Sequence[HeldRecord], counts: Sequence[Any]) -> None:
    """Hand each record's count (the reply's items after the transitions') to its holder."""
    for record, count in zip(records, counts, strict=True):
        if not record.count.done():
            record.count.set_result(int(count))


def failed(records: Sequence[HeldRecord], error: BaseException) -> None:
    """The call that carried these records failed: not known to be recorded."""
    for record in records:
        if record.count.done():
            continue  # its holder gave up waiting
        if isinstance(error, asyncio.CancelledError):
            record.count.cancel()
        else:
            record.count.set_exception(error)
