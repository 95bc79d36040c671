"""The prefix index's format in Redis, and what it means (no I/O here: see
coordinator/prefix_index.py, which reads and writes it with plain commands).

One hash per pool, `{pool}:prefix_index`, holding no text of any prompt:

- block hash -> "<id>#<epoch>|<position>[+<second>] ...": the instances that recorded
  the block, newest last, at most `prefix_max_owners`; "+<second>" marks a block the
  prompt went on past (every entry of a record but its deepest, the prompt's last
  block) and the Redis time it was recorded, in seconds: a lookup credited there
  soon after is another prompt through a shared prefix, not the next turn of that
  one (`HeldBlocks.continued`);
- "<id>#<epoch>" -> the instance's count at that epoch: the blocks recorded against
  it, which gives each entry its position;
- "<id>#" -> the latest epoch indexed for the id, which an automatic epoch continues
  above (lua/register.lua): an id registered again must not find its old entries
  valid;
- "#about": what the hash is (longer than hash-max-listpack-value, so Redis keeps the
  hash in its hashtable encoding: as a listpack, an HMGET of many fields would scan
  the whole hash once per field).

An entry is valid while its instance is at the entry's epoch and fewer than the
instance's capacity (in blocks) were recorded after it: the index is an LRU of each
instance's last `capacity` blocks, evicted by its count alone, so no write ever
deletes to keep an instance within its capacity. A node records an entry every
few blocks of a prompt (Settings.prefix_record_stride); an entry stands for the blocks
since the previous one (its weight), and a call's entries take positions deepest
first, so an instance loses a prompt's tail before its head, as an engine's cache
does. A refresh (weight 0) adds no block: it moves an entry the instance holds to its
count, as a cache hit moves a prefix to the front of an LRU.

Invalid entries cost storage only, never credit: a lookup checks every entry it
reads, and sampled records reclaim them (`reclaimed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

ABOUT = (
    'prefix index: block hash -> "<id>#<epoch>|<position>[+<second>]" owners, newest '
    "last ('+': the prompt went on past the block, at that Redis second); "
    '"<id>#<epoch>" -> blocks recorded; "<id>#" -> latest epoch indexed '
    "(coordinator/prefix_entries.py); no prompt text"
)


def stem(owner: str, epoch: int) -> str:
    """An instance's count field at one epoch, and the head of its entries."""
    return f"{owner}#{epoch}"


def owner_of(stem_: str) -> str:
    """The instance id of a stem ("<id>#<epoch>"): ids have no '#'."""
    return stem_.rpartition("#")[0]


def is_block(field: str) -> bool:
    """Whether an index field is a block hash: the others have a '#' ("<id>#<epoch>"
    counts, "<id>#" latest epochs, "#about")."""
    return "#" not in field


@dataclass(frozen=True, slots=True)
class Entry:
    """One owner of a block: the instance, its epoch, the position of the record, and
    when the recorded prompt went on past the block (Redis seconds; None: it ended
    there)."""

    owner: str
    epoch: int
    position: int
    continued: int | None = None

    @property
    def stem(self) -> str:
        return stem(self.owner, self.epoch)

    @property
    def text(self) -> str:
        """The entry as stored."""
        inside = "" if self.continued is None else f"+{self.continued}"
        return f"{self.stem}|{self.position}{inside}"


def parse_entries(raw: str | None) -> list[Entry]:
    """The entries of one block's value; anything else in it is left out."""
    out = []
    for text in (raw or "").split():
        head, _, position = text.rpartition("|")
        owner, _, epoch = head.rpartition("#")
        position, plus, second = position.partition("+")
        if plus and not second.isdigit():
            continue
        if owner and epoch.isdigit() and position.isdigit():
            out.append(Entry(owner, int(epoch), int(position), int(second) if plus else None))
    return out


def valid(position: int, count: int | None, capacity: int) -> bool:
    """Whether an entry at `position` is still within its instance's last `capacity`
    blocks, by the instance's count at the entry's epoch (None: gone). A count read
    before the entry was written is below its position: the entry is newer, so valid."""
    return count is not None and position > 0 and count - position < capacity


def current_stems(
    entries: Iterable[Sequence[Entry]], epoch_of: Callable[[str], int | None]
) -> list[str]:
    """The count fields a lookup needs, for the entries of its blocks: those of the
    owners named at their current epoch (an entry of another epoch is void at once: a
    restart empties the cache)."""
    out: dict[str, None] = {}
    for block in entries:
        for e in block:
            if e.stem not in out and epoch_of(e.owner) == e.epoch:
                out[e.stem] = None
    return list(out)


class HeldBlocks(dict[str, int]):
    """Blocks of a prompt each instance holds (a plain dict to everything that reads
    it), and `continued`: the instances whose deepest credited entry is one a
    recorded prompt went on past, with the Redis second it was recorded. A
    conversation's next turn is credited at its previous prompt's last block; a
    credit inside another prompt means this prompt shares only a prefix with it (a
    system prompt, a document), whichever node routed that one."""

    __slots__ = ("continued",)

    def __init__(
        self, held: Mapping[str, int] | None = None, continued: Mapping[str, int] | None = None
    ):
        super().__init__(held or {})
        self.continued: Mapping[str, int] = continued or {}


def cached_blocks(
    entries: Sequence[Sequence[Entry]],
    counts: Mapping[str, int | None],
    epoch_of: Callable[[str], int | None],
    capacity_of: Callable[[str], int],
) -> HeldBlocks:
    """Blocks of the prompt each instance holds, from the entries of its blocks in
    prompt order (`parse_entries` of each value) and the counts of their owners
    (`current_stems`).

    An instance holding block i holds the prompt up to the end of block i: the hash
    chains over everything before it, and an engine's cache drops a prefix's tail
    before its head. So the credit is the deepest valid entry, even where shallower
    entries of the same prompt fell out first (a node refreshes only the deepest block
    a request held, see `PrefixIndex.record`).
    """
    held: dict[str, int] = {}
    continued: dict[str, int] = {}
    for position in range(len(entries) - 1, -1, -1):
        for e in entries[position]:
            if e.owner in held or epoch_of(e.owner) != e.epoch:
                continue
            if valid(e.position, counts.get(e.stem), capacity_of(e.owner)):
                held[e.owner] = position + 1
                if e.continued is not None:
                    continued[e.owner] = e.continued
    return HeldBlocks(held, continued)


def reclaimed(
    sampled: Sequence[tuple[str, str]],
    epochs: Mapping[str, int | None],
    counts: Mapping[str, int | None],
    capacity_of: Callable[[str], int],
) -> tuple[list[str], dict[str, str]]:
    """What to delete and rewrite among sampled (field, value) pairs of the index,
    given the registered epoch of every id they name and the counts of the stems
    (`sampled_names`): block values keep their valid entries only, and the counts
    of other epochs than the id's registered one go. "<id>#" and "#" fields stay."""
    dels: list[str] = []
    sets: dict[str, str] = {}
    for field, value in sampled:
        if not is_block(field):
            owner, _, epoch = field.rpartition("#")
            if owner and epoch and (not epoch.isdigit() or epochs.get(owner) != int(epoch)):
                dels.append(field)  # a count of another epoch than the registered one
            continue
        kept = [
            e.text
            for e in parse_entries(value)
            if epochs.get(e.owner) == e.epoch
            and valid(e.position, counts.get(e.stem), capacity_of(e.owner))
        ]
        if not kept:
            dels.append(field)
        elif len(kept) < len(value.split()):
            sets[field] = " ".join(kept)
    return dels, sets


def sampled_names(sampled: Sequence[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The ids and count fields `reclaimed` needs, for the sampled fields."""
    owners: dict[str, None] = {}
    stems: dict[str, None] = {}
    for field, value in sampled:
        if not is_block(field):
            if owner_of(field) and not field.endswith("#"):  # a count
                owners[owner_of(field)] = None
            continue
        for e in parse_entries(value):
            owners[e.owner] = None
            stems[e.stem] = None
    return list(owners), list(stems)


COUNT_FRESH_MS = 1000.0  # how long a count seen stands for the instance's, its growth unknown
COUNT_FRESH_MAX_MS = 10_000.0  # ... at most, however slowly it grows
COUNT_FRESH_MIN_MS = 100.0  # ... at least, however fast
DRIFT_SHARE = 1 / 32  # of an instance's capacity its count may move on unseen, by its rate
RATE_SPAN_MS = 60_000.0  # growth is measured over at most about this long


@dataclass(slots=True)
class _Seen:
    count: int
    at: float
    base_count: int  # an earlier observation, to measure the growth from
    base_at: float


class SeenCounts:
    """Counts a node read or wrote lately, each standing for its instance's count for
    a while: counts only grow, so one seen earlier is a floor (an entry above it is
    newer, so valid), and an entry below it may have fallen out since, unseen. The
    while is the time the count takes to move `DRIFT_SHARE` of the instance's capacity
    on at the rate it grew between this node's observations (within
    COUNT_FRESH_MIN_MS..COUNT_FRESH_MAX_MS; COUNT_FRESH_MS until that rate is known), so
    an entry credited after it fell out is at most about that share of the cache past
    its edge."""

    def __init__(self, kept: int = 4096) -> None:
        self._kept = kept
        self._seen: dict[str, _Seen] = {}

    def clear(self) -> None:
        """Forget every count (Redis lost the pool: the counts start again from 0)."""
        self._seen.clear()

    def note(self, stem_: str, count: int, now: float) -> None:
        """A count read or written at `now` (ms)."""
        seen = self._seen.get(stem_)
        if seen is None or count < seen.count:  # new, or the index was emptied
            if len(self._seen) >= self._kept:
                self._seen = {s: v for s, v in self._seen.items() if now - v.at <= RATE_SPAN_MS}
            self._seen[stem_] = _Seen(count, now, count, now)
            return
        if now - seen.base_at > RATE_SPAN_MS:  # measure from the last observation on
            seen.base_count, seen.base_at = seen.count, seen.at
        seen.count, seen.at = count, now

    def fresh(self, stem_: str, capacity: int, now: float) -> int | None:
        """The count seen for `stem_` if it still stands for the instance's, else None."""
        seen = self._seen.get(stem_)
        if seen is None or now - seen.at > self.window_ms(seen, capacity):
            return None
        return seen.count

    @staticmethod
    def window_ms(seen: _Seen, capacity: int) -> float:
        span = seen.at - seen.base_at
        if span < COUNT_FRESH_MS:
            return COUNT_FRESH_MS
        rate = (seen.count - seen.base_count) / span  # blocks per ms
        if rate <= 0:
            return COUNT_FRESH_MAX_MS
        return min(COUNT_FRESH_MAX_MS, max(COUNT_FRESH_MIN_MS, DRIFT_SHARE * capacity / rate))
