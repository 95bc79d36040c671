"""Prefix blocks of a prompt: a canonical prompt string, cut into fixed-size blocks,
hashed as a salted chain.

Blocks are characters, not tokens: the node has no tokenizer (tokens.py estimates
tokens as characters / 4), and a character block boundary depends only on the text,
so every node and the mock engine cut a prompt the same way. A block of
`block_chars` characters stands for `block_chars / CHARS_PER_TOKEN` tokens.

Each block's hash covers its whole prefix (`h_i = H(h_{i-1} || block_i)`), so equal
hashes at position i mean equal prompts up to the end of block i: this is how an
engine's prefix KV cache matches, and why one hash per block is enough to ask "how
much of this prompt does an instance hold". Only whole blocks are hashed (an engine
caches whole blocks too). The hash is keyed BLAKE2b: the key mixes the pool name and
a deployment secret (`Settings.prefix_salt`), so equal prompts in different pools or
deployments do not share hashes, and nobody without the salt can test a guessed
prompt against the index (docs/security.md). No text is kept.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from coordinator.prefix_entries import HeldBlocks
from coordinator.tokens import CHARS_PER_TOKEN, content_text

V = TypeVar("V")
DIGEST_BYTES = 8  # 64-bit block hashes: 16 hex characters in Redis
# Separators that cannot occur inside a role name, so role/content splits are unambiguous.
ROLE_END, MESSAGE_END = "\x1f", "\x1e"


def canonical_prompt(body: dict[str, Any]) -> str:
    """The prompt of a chat or completion request as one deterministic string.

    Chat: for each message in order, `role`, U+001F, the text of its content (string
    or the `text` of its content parts, concatenated), U+001E. A follow-up turn, which
    repeats the conversation so far, therefore starts with the previous turn's string.
    Completion: the `prompt` string (a list of prompts: the first one). Anything else:
    the empty string (no blocks).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role', '')}{ROLE_END}{content_text(m.get('content'))}{MESSAGE_END}"
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("role", ""), str)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def salt_key(pool: str, salt: str) -> bytes:
    """The BLAKE2b key of a pool: pool name and deployment salt, at most 64 bytes."""
    return hashlib.blake2b(f"{pool}\0{salt}".encode(), digest_size=32).digest()


def chain_hashes(blocks: Sequence[bytes], key: bytes) -> list[str]:
    """Chained keyed hashes of blocks, as hex: each covers every block up to it."""
    out: list[str] = []
    previous = b""
    for block in blocks:
        digest = hashlib.blake2b(previous + block, key=key, digest_size=DIGEST_BYTES).digest()
        out.append(digest.hex())
        previous = digest
    return out


class PromptBlocks(list[str]):
    """The block hashes of one prompt (a plain list to everything that reads it), and
    the prompt's text, which stays in the node's memory: `after` gives what follows a
    block, which tells a conversation's next turn from another prompt through the
    same blocks (`HotPrefixes`)."""

    __slots__ = ("block_chars", "text")

    def __init__(self, hashes: Iterable[str], text: str, block_chars: int) -> None:
        super().__init__(hashes)
        self.text = text
        self.block_chars = block_chars

    def after(self, depth: int) -> str:
        """At most one block of the text that follows block `depth` (from 1)."""
        start = depth * self.block_chars
        return self.text[start : start + self.block_chars]


def block_hashes(text: str, key: bytes, block_chars: int, max_blocks: int) -> PromptBlocks:
    """Hashes of the first `max_blocks` whole blocks of `text`."""
    if block_chars < 1:
        raise ValueError("block_chars must be >= 1")
    whole = min(len(text) // block_chars, max_blocks)
    blocks = [
        text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        for i in range(whole)
    ]
    return PromptBlocks(chain_hashes(blocks, key), text, block_chars)


def block_tokens(block_chars: int) -> int:
    """Tokens one character block stands for (the chars/4 rule, at least 1)."""
    return max(1, block_chars // CHARS_PER_TOKEN)


class CachedTokens(dict[str, int]):
    """Expected cached prompt tokens per instance (a plain dict to everything that
    reads it), and `hot`: the instances whose credited prefix is hot, i.e. this node
    routed it moments ago under another prompt (`HotPrefixes`), and `popular`: those
    of them whose prefix went under several. The hot-spot guard fades a hot prefix's
    credit over its shorter hot distance; a plain mapping of cached tokens has no hot
    prefixes. `most_inflight`: for the instances that kept a hot prefix's credit under
    the bounded loads (`guarded_cached_tokens`), the most requests in flight each may
    have, before this one, for reserve to still take it (coordinator/guard.py);
    `crowded`: the instances over their share under those bounded loads, which the
    request passes by (consistent hashing with bounded loads passes a full bin by,
    not only its credit): reserve gets them after the others.
    """

    __slots__ = ("crowded", "hot", "most_inflight", "popular")

    def __init__(
        self,
        tokens: Mapping[str, int] | None = None,
        hot: Iterable[str] = (),
        popular: Iterable[str] = (),
        most_inflight: Mapping[str, int] | None = None,
        crowded: Iterable[str] = (),
    ) -> None:
        super().__init__(tokens or {})
        self.hot: frozenset[str] = frozenset(hot)
        # Of `hot`, those whose credited block went under several prompts lately
        # (POPULAR_COUNT): spreading such a prefix pays for its copy, whatever its size.
        self.popular: frozenset[str] = frozenset(popular)
        self.most_inflight: Mapping[str, int] = most_inflight or {}
        self.crowded: frozenset[str] = frozenset(crowded)


class _Window(Generic[V]):
    """Values per key for one node, in two generations, each `window_ms` long at most
    (and at most `max_size` keys): a key stays from `window_ms` to twice that after it
    was last written. Node-local and approximate on purpose. A `window_ms` of 0 or
    less keeps nothing."""

    def __init__(self, window_ms: float, max_size: int = 65_536) -> None:
        self.window_ms = window_ms
        self.max_size = max_size
        self._current: dict[Hashable, V] = {}
        self._previous: dict[Hashable, V] = {}
        self._started_ms: float | None = None

    def _age(self, now_ms: float) -> None:
        if self._started_ms is None:
            self._started_ms = now_ms
        elapsed = now_ms - self._started_ms
        if elapsed >= 2 * self.window_ms:
            self._current, self._previous = {}, {}
            self._started_ms = now_ms
        elif elapsed >= self.window_ms or len(self._current) >= self.max_size:
            self._current, self._previous = {}, self._current
            self._started_ms = now_ms


class RecentStarts:
    """How many requests the whole fleet sent each instance lately: the growth of the
    instances' `started` counters (coordinator/packed.py) since a mark this node took
    from its view `window_ms` to about twice that ago (two generations, as `_Window`;
    a mark older than twice the window is dropped). A node's view shows its own
    reserves at once (their replies carry the records they wrote) and the other
    nodes' within `snapshot_max_age_ms`: so every node bounds an instance by the
    same counts, and nodes that each find an instance least routed by themselves do
    not all send it their next request. A `window_ms` of 0 or less counts nothing."""

    def __init__(self, window_ms: float) -> None:
        self.window_ms = window_ms
        self._previous: dict[str, int] = {}
        self._current: dict[str, int] = {}
        self._marked_ms: float | None = None

    def counts(self, started: Mapping[str, int], now_ms: float) -> dict[str, float]:
        """Requests each instance took since the older mark, from `started` (the
        instances' counters now). An instance the mark does not know counts from 0 (a
        slot's counter starts at 0), and so does one whose counter went down: its slot
        was freed and taken again, or the counter wrapped (then a few of the requests
        before the wrap go uncounted, once in packed.STARTED_WRAP)."""
        if self.window_ms <= 0:
            return {}
        marked = self._marked_ms
        if marked is None or now_ms - marked >= 2 * self.window_ms:
            self._previous = self._current = dict(started)
            self._marked_ms = now_ms
        elif now_ms - marked >= self.window_ms:
            self._previous, self._current = self._current, dict(started)
            self._marked_ms = now_ms
        base = self._previous
        out = {}
        for iid, n in started.items():
            before = base.get(iid, 0)
            grown = n - before if n >= before else n
            if grown:
                out[iid] = float(grown)
        return out


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


class HotPrefixes(_Window[list[Any]]):
    """The block hashes one node routed recently: what makes a prefix popular *now*.

    A block is hot once this node routed it for two different prompts within the
    window (two generations, as `_Window`). A block routed inside a prompt is hot
    at once: the next prompt credited with it goes on differently. A prompt's last
    (hashed) block is hot only once a second prompt that does not continue the first
    was routed through it, or asks now: a conversation's next turn repeats the whole
    previous prompt, tail included, and must keep its holder, while a shared system
    prompt or document is the same few blocks under prompt after prompt. For the last
    block the node keeps the length and an 8-byte digest of what followed it (at most
    one block of text), never the text. A prompt without text (`tail` None: the
    simulator's trace blocks) continues whatever came before.
    """

    # values: block -> [distinct prompts, tail length, tail digest] (length -1: no tail)

    def _seen(self, block: Hashable) -> tuple[int, int, bytes | None]:
        """Distinct prompts through `block` in both generations, and the newest tail."""
        now, before = self._current.get(block), self._previous.get(block)
        count = (now[0] if now else 0) + (before[0] if before else 0)
        newest = now if now and now[1] >= 0 else before
        return count, (newest[1] if newest else -1), (newest[2] if newest else None)

    @staticmethod
    def _continues(after: str | None, length: int, digest: bytes | None) -> bool:
        if after is None or digest is None:
            return True
        return len(after) >= length and _digest(after[:length]) == digest

    def note(self, blocks: Sequence[Hashable], now_ms: float, tail: str | None = None) -> None:
        """This node routed a prompt with these blocks (in order) at `now_ms`; `tail`
        is what followed its last block (`PromptBlocks.after`), None if unknown."""
        if self.window_ms <= 0 or not blocks:
            return
        self._age(now_ms)
        current = self._current
        for block in blocks[:-1]:
            entry = current.setdefault(block, [0, -1, None])
            entry[0] += 2
        last = blocks[-1]
        count, length, digest = self._seen(last)
        entry = current.setdefault(last, [0, -1, None])
        if count == 0 or not self._continues(tail, length, digest):
            entry[0] += 1
        if tail is not None:
            entry[1], entry[2] = len(tail), _digest(tail)

    def popularity(self, block: Hashable, now_ms: float, after: str | None = None) -> int:
        """How popular `block` is: 2 for each prompt this node routed it inside within
        the window, 1 for each prompt it ended that did not continue the one before,
        and 1 more when the prompt that asks (`after`: what follows `block` in it)
        does not continue the last. 2 or more is hot."""
        if self.window_ms <= 0:
            return 0
        self._age(now_ms)
        count, length, digest = self._seen(block)
        return count + (count >= 1 and not self._continues(after, length, digest))

    def is_hot(self, block: Hashable, now_ms: float, after: str | None = None) -> bool:
        """Whether `block` is popular: two prompts through it within the window, or
        one and a prompt that does not continue it."""
        return self.popularity(block, now_ms, after) >= 2


POPULAR_COUNT = 8  # popularity of a prefix that went inside 4 prompts lately
CHEAP_COPY_SHARE = 32  # a prefix of at most 1/32 of a cache is cheap to copy


def cheap_copy_tokens(cache_tokens: int) -> int:
    """The longest credited prefix the bounded loads spread whatever its popularity:
    1/CHEAP_COPY_SHARE of an instance's prefix cache (12,500 tokens of the default
    400,000), a system prompt's size rather than a document's."""
    return cache_tokens // CHEAP_COPY_SHARE


def hot_instances(
    held: Mapping[str, int],
    blocks: Sequence[Hashable],
    hot: HotPrefixes,
    now_ms: float,
    redis_now_ms: float,
) -> tuple[set[str], set[str]]:
    """Instances whose deepest credited block (of `held` blocks each) is hot, and those
    of them where it is popular (`POPULAR_COUNT`), for the prompt of `blocks` (with
    its text when they are `PromptBlocks`). A block is hot where this node routed it
    lately under another prompt (`HotPrefixes`), and where the index shows that some
    node's prompt went on past it within the same window (`HeldBlocks.continued`, to
    the second of `redis_now_ms`, the Redis clock): this prompt then shares only a
    prefix with one routed moments ago, so each node's first request through a shared
    system prompt is guarded too, not only its later ones. A window of 0 makes none
    hot."""
    text = blocks if isinstance(blocks, PromptBlocks) else None
    heat = {
        iid: hot.popularity(blocks[depth - 1], now_ms, text.after(depth) if text else None)
        for iid, depth in held.items()
        if depth > 0
    }
    continued = held.continued if isinstance(held, HeldBlocks) and hot.window_ms > 0 else {}
    since = (redis_now_ms - hot.window_ms) / 1000 - 1  # a second's rounding
    for iid, at in continued.items():
        if at >= since and iid in heat:
            heat[iid] = max(heat[iid], 2)
    return (
        {iid for iid, n in heat.items() if n >= 2},
        {iid for iid, n in heat.items() if n >= POPULAR_COUNT},
    )


def hot_capacity(total: float, instances: int, load_pct: int) -> int | None:
    """The most load an instance may carry, this request included, to keep a hot
    prefix's credit: the bounded-loads rule of consistent hashing (Mirrokni, Thorup,
    Zadimoghaddam 2018), load_pct/100 x (`total` load of the pool + this request) /
    `instances`, rounded down but at least 1: with the few requests a lightly loaded
    pool has, rounding up would let a holder take twice its share. None when
    `load_pct` is 0 (off) or no instance is known."""
    if load_pct <= 0 or instances <= 0:
        return None
    return max(1, math.floor(load_pct * (total + 1) / (100 * instances)))


class Room:
    """Whether an instance has room for one more request of a hot prefix (call it
    with the instance id), and `most_inflight`: the most requests in flight on the
    pool an instance may have, before this one, to have room (None: no bound on them).
    The node's view of the counts may be a few hundred ms old: reserve enforces
    `most_inflight` on Redis's counts, so that nodes whose views all show the holder
    idle do not all give it the prefix's next request. `instances`: the instances
    the loads cover (`crowded` names those of them without room; one not among them
    has no room). `idle`: whether some instance is idle, so that a holder without
    room loses its credit and the request passes every instance without room by;
    else it passes only holders without room by, and only while another holder has
    room (`idle_fleet_room`). Each load maps an instance to its load (0 when absent)
    and comes with its capacity (None: no bound)."""

    __slots__ = ("_loads", "idle", "instances", "most_inflight")

    def __init__(
        self,
        loads: Sequence[tuple[Mapping[str, float], int | None]],
        most_inflight: int | None = None,
        instances: Collection[str] = (),
        idle: bool = True,
    ) -> None:
        self._loads = loads
        self.most_inflight = most_inflight
        self.instances = instances  # not copied: a pool may have thousands
        self.idle = idle

    def __call__(self, iid: str) -> bool:
        if self.instances and iid not in self.instances:
            return False
        return all(cap is None or load.get(iid, 0) + 1 <= cap for load, cap in self._loads)

    def _over(self, load: Mapping[str, float], capacity: int | None) -> frozenset[str]:
        if capacity is None:
            return frozenset()
        return frozenset(i for i, v in load.items() if v + 1 > capacity and i in self.instances)

    def crowded(self) -> frozenset[str]:
        """The instances without room. When that is every one (with two loads, every
        instance can be over its share of one or the other), those over their share
        of the last load alone, unless that too is every one: so a request still
        goes to an instance within its share of the fleet's recent requests, the
        longer view, when the counts in flight leave none. Reads each load's entries
        once (a pool may have thousands of instances)."""
        over = [self._over(load, capacity) for load, capacity in self._loads]
        full = frozenset().union(*over)
        if len(full) < len(self.instances) or len(over) < 2:
            return full
        return over[-1] if len(over[-1]) < len(self.instances) else full


def hot_room(
    loads: Sequence[tuple[Mapping[str, float], float]],
    instances: int,
    load_pct: int,
    pool: int | None = None,
    ids: Collection[str] = (),
    idle: bool = True,
) -> Room | None:
    """Whether an instance has room for one more request of a hot prefix under every
    one of `loads` ((load per instance, total of the pool) pairs): within
    `hot_capacity` of each. None when the rule is off. `pool`: which of `loads`
    counts the pool's requests in flight (Room.most_inflight comes from its
    capacity); `ids`: the instances they cover (Room.instances); `idle`: Room.idle."""
    if load_pct <= 0 or instances <= 0:
        return None
    capacities = [(load, hot_capacity(total, instances, load_pct)) for load, total in loads]
    most = None
    if pool is not None:
        cap = capacities[pool][1]
        most = None if cap is None else cap - 1
    return Room(capacities, most, ids, idle)


def idle_fleet_room(
    inflight: Mapping[str, float], recent: Mapping[str, float], load_pct: int
) -> Room | None:
    """The hot-spot guard's bounded loads as the nodes apply them, on the pool's
    requests in flight (`inflight`, per alive instance) and the requests the fleet
    sent each instance lately (`recent`: `RecentStarts`), while an instance is idle
    (nothing in flight). With no instance idle, on the recent requests alone and only
    among the prefix's holders (`Room.idle` False): there the counts in flight say
    little (a few long requests each) and denying a holder its credit would copy the
    prefix into another cache for nothing, but of several holders the request may as
    well go to one within its share. None when the rule is off."""
    if load_pct <= 0 or not inflight:
        return None
    routed = (recent, sum(recent.values()))
    if min(inflight.values()) > 0:
        return hot_room([routed], len(inflight), load_pct, ids=inflight, idle=False)
    return hot_room(
        [(inflight, sum(inflight.values())), routed],
        len(inflight),
        load_pct,
        pool=0,
        ids=inflight,
    )


def guarded_cached_tokens(
    cached: Mapping[str, int],
    backlog_of: Callable[[str], float | None],
    floor_backlog_ms: float,
    guard_ms: int,
    hot_guard_ms: int = 0,
    room: Callable[[str], bool] | None = None,
    cheap_copy: int = 0,
) -> CachedTokens:
    """The hot-spot guard: cache credit fades as an instance gets busier than the least
    busy candidate, and is gone once it is `guard_ms` of backlog ahead (`hot_guard_ms`
    for the instances `CachedTokens.hot` names).

    Without it, the score sends every request of a popular prefix to its one holder
    until that holder's queue is as long as the prefill the cache saves (for a
    30k-token prefix, over 2 s) while other instances idle. With it, once the holder is
    the guard distance busier than the idlest instance, the next request goes where
    the load is lowest and that instance computes (and from then on holds) the prefix
    too: a popular prefix spreads over as many instances as its load needs.

    Two distances, because a busy holder means two different things. A hot prefix
    (this node routed it moments ago, `HotPrefixes`) is popular now: its holder is
    busy with the prefix's own requests, and a second holder pays off at once, so its
    credit fades over the short `hot_guard_ms`. Any other credit is a conversation's
    next turn whose holder is busy with other work: sending it away computes its
    whole history again and copies it into a second cache, evicting other prefixes
    there, so its credit fades only over the long `guard_ms` (a long queue ahead
    also overwrites the holder's cache before the request's prefill starts).
    `guard_ms` = 0 turns the guard off (no credit is ever faded); `hot_guard_ms` = 0
    leaves hot prefixes to `guard_ms`. An instance without a known backlog keeps no
    credit.

    Backlog alone does not spread a popular prefix while the fleet is lightly loaded:
    a shared system prompt's holder stays within any backlog distance of the idlest
    instance (and has few requests in flight), and takes every conversation's first
    turn while the others idle. So a hot prefix's credit also needs `room` (see
    `hot_room()`, the bounded-loads rule): the nodes give it the requests in flight
    in the pool and those the fleet sent each instance lately (`RecentStarts`). A
    holder over its share loses the credit, the request goes where the load is, and
    that instance holds the prefix from then on. Once several instances hold it,
    losing credit changes nothing, so the result names the instances over their
    share (`CachedTokens.crowded`), which the request passes by, and bounds the
    others' requests in flight on Redis (`CachedTokens.most_inflight`). With no
    instance idle (`Room.idle` False) no credit is lost, and the request passes by
    only holders over their share of the fleet's recent requests while another
    holder is within it. All of this only where a copy pays: a short prefix (at
    most `cheap_copy` tokens, a small share of a cache: `cheap_copy_tokens()`) or a
    popular one (`CachedTokens.popular`, whose copy serves the requests to come). A
    long prefix that went under one other prompt stays with its holder under the
    backlog guard: copying it would evict a large share of another cache for a
    request or two.
    Conversations' next turns are not hot (`HotPrefixes`) and keep their holder.
    """
    if guard_ms <= 0:
        return CachedTokens(cached)
    hot: frozenset[str] = frozenset()
    popular: frozenset[str] = frozenset()
    if isinstance(cached, CachedTokens):
        hot, popular = cached.hot, cached.popular
    out: dict[str, int] = {}
    bounded: dict[str, int] = {}  # most_inflight of the holders that keep credit
    most = room.most_inflight if isinstance(room, Room) else None

    def applies(iid: str, tokens: int) -> bool:
        return iid in hot and room is not None and (tokens <= cheap_copy or iid in popular)

    # The bounded loads pass crowded instances by only when the deepest credit is a hot
    # prefix they apply to: a deeper one elsewhere is a conversation's own history.
    deepest = max(cached.values(), default=0)
    spread = deepest > 0 and all(applies(i, t) for i, t in cached.items() if t == deepest)
    idle = not isinstance(room, Room) or room.idle
    for iid, tokens in cached.items():
        backlog = backlog_of(iid)
        if backlog is None:
            continue
        bounds = applies(iid, tokens)
        if bounds and idle and not (room is not None and room(iid)):
            continue
        distance = hot_guard_ms if iid in hot and hot_guard_ms > 0 else guard_ms
        share = 1.0 - max(0, backlog - floor_backlog_ms) / distance
        if share > 0:
            out[iid] = int(tokens * min(1.0, share))
            if bounds and most is not None:
                bounded[iid] = most
    crowded: frozenset[str] = frozenset()
    if spread and isinstance(room, Room):
        if idle:
            crowded = room.crowded()
        else:
            holders = [iid for iid, tokens in cached.items() if tokens == deepest]
            full = frozenset(iid for iid in holders if not room(iid))
            crowded = full if len(full) < len(holders) else frozenset()
    return CachedTokens(
        out,
        most_inflight=bounded,
        crowded=crowded,
    )
