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
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from coordinator.tokens import CHARS_PER_TOKEN, content_text

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


def block_hashes(text: str, key: bytes, block_chars: int, max_blocks: int) -> list[str]:
    """Hashes of the first `max_blocks` whole blocks of `text`."""
    if block_chars < 1:
        raise ValueError("block_chars must be >= 1")
    whole = min(len(text) // block_chars, max_blocks)
    blocks = [
        text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        for i in range(whole)
    ]
    return chain_hashes(blocks, key)


def block_tokens(block_chars: int) -> int:
    """Tokens one character block stands for (the chars/4 rule, at least 1)."""
    return max(1, block_chars // CHARS_PER_TOKEN)


def parse_owners(raw: str) -> list[tuple[str, int]]:
    """The (instance id, epoch) entries of one owners value ("<id>|<epoch>|<stamp> ...")."""
    out = []
    for entry in raw.split():
        owner, _, rest = entry.partition("|")
        epoch, _, _stamp = rest.partition("|")
        if owner and epoch.isdigit():
            out.append((owner, int(epoch)))
    return out


def cached_blocks(
    owner_values: Sequence[str | None], epoch_of: Callable[[str], int | None]
) -> dict[str, int]:
    """Blocks of the prompt each instance holds, from the owners of its blocks in order.

    An instance holding block i holds the prompt up to the end of block i: the hash
    chains over everything before it, and an engine's cache drops a prefix's tail
    before its head. So the credit is the deepest block held, even where shallower
    entries of the index were evicted first (a node refreshes only the blocks it
    adds, see `PrefixIndex.record`). An entry counts only at the instance's current
    epoch: a restart empties the engine's cache, and so voids the index at once.
    """
    held: dict[str, int] = {}
    for position in range(len(owner_values) - 1, -1, -1):
        for owner, epoch in parse_owners(owner_values[position] or ""):
            if owner not in held and epoch_of(owner) == epoch:
                held[owner] = position + 1
    return held


class CachedTokens(dict[str, int]):
    """Expected cached prompt tokens per instance (a plain dict to everything that
    reads it), and `hot`: the instances whose credited prefix is hot, i.e. this node
    routed a request with that prefix moments ago (`HotPrefixes`). The hot-spot guard
    fades a hot prefix's credit over its shorter hot distance; a plain mapping of
    cached tokens has no hot prefixes.
    """

    __slots__ = ("hot",)

    def __init__(self, tokens: Mapping[str, int] | None = None, hot: Iterable[str] = ()) -> None:
        super().__init__(tokens or {})
        self.hot: frozenset[str] = frozenset(hot)


class RecentCounts:
    """How often one node saw each key lately: two generations of counts, each
    `window_ms` long at most (and at most `max_size` keys), so a key counts from
    `window_ms` to twice that after it was seen. Node-local and approximate on purpose.
    A `window_ms` of 0 or less counts nothing."""

    def __init__(self, window_ms: float, max_size: int = 65_536) -> None:
        self.window_ms = window_ms
        self.max_size = max_size
        self._current: dict[Hashable, int] = {}
        self._previous: dict[Hashable, int] = {}
        self._totals = [0, 0]  # current, previous
        self._started_ms: float | None = None

    def _age(self, now_ms: float) -> None:
        if self._started_ms is None:
            self._started_ms = now_ms
        elapsed = now_ms - self._started_ms
        if elapsed >= 2 * self.window_ms:
            self._current, self._previous, self._totals = {}, {}, [0, 0]
            self._started_ms = now_ms
        elif elapsed >= self.window_ms or len(self._current) >= self.max_size:
            self._current, self._previous = {}, self._current
            self._totals = [0, self._totals[0]]
            self._started_ms = now_ms

    def note(self, keys: Iterable[Hashable], now_ms: float) -> None:
        """Count each of `keys` once at `now_ms`."""
        if self.window_ms <= 0:
            return
        self._age(now_ms)
        current = self._current
        for key in keys:
            current[key] = current.get(key, 0) + 1
            self._totals[0] += 1

    def count(self, key: Hashable, now_ms: float) -> int:
        """How often `key` was seen within the window."""
        if self.window_ms <= 0:
            return 0
        self._age(now_ms)
        return self._current.get(key, 0) + self._previous.get(key, 0)

    def total(self, now_ms: float) -> int:
        """How many keys were seen within the window."""
        if self.window_ms <= 0:
            return 0
        self._age(now_ms)
        return self._totals[0] + self._totals[1]


class HotPrefixes(RecentCounts):
    """The block hashes one node routed recently: what makes a prefix popular *now*.

    A hash is hot once the node routed it at least twice within the window. Twice, not
    once: a conversation's next turn is credited with the deepest block of its previous
    turn, which one request routed, while a shared system prompt or document is routed
    by request after request. A popular prefix reaches every node behind the balancer
    within the window.
    """

    def is_hot(self, block: Hashable, now_ms: float) -> bool:
        """Whether this node routed requests holding `block` twice within the window."""
        return self.count(block, now_ms) >= 2


def hot_instances(
    held: Mapping[str, int], blocks: Sequence[Hashable], hot: HotPrefixes, now_ms: float
) -> set[str]:
    """Instances whose deepest credited block (of `held` blocks each) is hot."""
    return {
        iid for iid, depth in held.items() if depth > 0 and hot.is_hot(blocks[depth - 1], now_ms)
    }


def hot_capacity(routed: float, instances: int, load_pct: int) -> int | None:
    """Requests a node may have routed lately to an instance for it to keep a hot
    prefix's credit: the bounded-loads rule of consistent hashing (Mirrokni, Thorup,
    Zadimoghaddam 2018), load_pct/100 x (`routed` requests + this one) / `instances`,
    rounded down but at least 1: with the few requests a lightly loaded node routes
    in a window, rounding up would let a holder take twice its share. None when
    `load_pct` is 0 (off) or no instance is known."""
    if load_pct <= 0 or instances <= 0:
        return None
    return max(1, math.floor(load_pct * (routed + 1) / (100 * instances)))


def guarded_cached_tokens(
    cached: Mapping[str, int],
    backlog_of: Callable[[str], float | None],
    floor_backlog_ms: float,
    guard_ms: int,
    hot_guard_ms: int = 0,
    routed_of: Callable[[str], float | None] | None = None,
    hot_capacity: int | None = None,
) -> dict[str, int]:
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
    turn while the others idle. So a hot prefix's credit also needs room under
    `hot_capacity` (`hot_capacity()`, the bounded-loads rule) for the requests this
    node routed there lately (`routed_of`, a `RecentCounts` over the hot window): at
    most that many with this one. A holder over it loses the credit, the request goes
    where the load is, and that instance holds the prefix from then on.
    Conversations' next turns are not hot (`HotPrefixes`) and keep their holder.
    """
    if guard_ms <= 0:
        return dict(cached)
    hot: frozenset[str] = frozenset()
    if isinstance(cached, CachedTokens):
        hot = cached.hot
    out: dict[str, int] = {}
    for iid, tokens in cached.items():
        backlog = backlog_of(iid)
        if backlog is None:
            continue
        if iid in hot and hot_capacity is not None and routed_of is not None:
            routed = routed_of(iid)
            if routed is None or routed + 1 > hot_capacity:
                continue
        distance = hot_guard_ms if iid in hot and hot_guard_ms > 0 else guard_ms
        share = 1.0 - max(0, backlog - floor_backlog_ms) / distance
        if share > 0:
            out[iid] = int(tokens * min(1.0, share))
    return out
