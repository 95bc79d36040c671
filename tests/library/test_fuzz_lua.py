"""Hypothesis fuzz of every Lua script's ARGV against the real server.

Each example rebuilds a small pool (two instances, a prefill and a decode
reservation, one node lease), then calls one script directly, bypassing the Python
validation, with arguments that are valid for its header or mutated: random text and
bytes, negative, fractional, huge and special numbers ('-0', 'nan', '0x10', ' 5'),
empty strings, missing and extra arguments. Then:

- the call succeeds, or fails with a mapped error (ScriptArgumentError with a clear
  message; UnknownInstanceError / EpochFencedError where the header names them);
  never a raw Redis error, which would mean the script crashed half-way;
- a refused call, and a call whose reply says it changed nothing (a read, a
  no-op release, a stale reserve, ...), leave every key of the pool as it was;
- an unmutated call is never refused as a bad argument;
- after an accepted call the pool still decodes (a fresh node can read it) and
  every counter equals its live reservations (DESIGN.md §6).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.connection import connect_redis
from coordinator.errors import (
    EpochFencedError,
    ScriptArgumentError,
    UnknownInstanceError,
    from_response_error,
)
from coordinator.keys import ID_RE
from coordinator.packed import as_text, pack_candidate
from coordinator.scripts import SCRIPT_NAMES
from coordinator.timing import add_sample, empty_record, pack
from tests.helpers import assert_counters_match_reservations, delete_pool

pytestmark = pytest.mark.timeout(120)

NODE = "n1"
SETTINGS = Settings(redis_timeout_ms=5000, instance_ttl_ms=600_000, lease_ms=600_000)
PREFILL_RID, DECODE_RID = "r-prefill", "r-decode"
INSTANCES = ("i0", "i1")
EXAMPLES = 60  # per script

# ---------------------------------------------------------------------- arguments

ids = st.sampled_from([*INSTANCES, "ghost", NODE, "n0"]) | st.from_regex(ID_RE, fullmatch=True)
rids = st.sampled_from([PREFILL_RID, DECODE_RID, "r-new"]) | st.from_regex(ID_RE, fullmatch=True)
since = st.integers(0, 10**15).map(str) | st.sampled_from(["0", "0"])
run_ids = st.text(max_size=24)
tokens = st.integers(0, 10_000_000).map(str)
ms = st.integers(0, 86_400_000).map(str)
counts = st.integers(0, 10**15).map(str)
flags = st.sampled_from(["0", "1"])
phases = st.sampled_from(["prefill", "decode"])
hint = st.just("") | st.floats(0, 1e12).map(repr) | st.integers(0, 10**12).map(str)

# Numbers a script may half-accept: '-0' reaches Redis as "-0", which HINCRBY refuses.
odd_numbers = st.sampled_from(["-0", "-0.0", "-1", "0x10", " 5", "1e3", "1.5", "nan", "-inf"])
junk = st.one_of(
    st.just("-0"),
    odd_numbers,
    odd_numbers,
    st.text(max_size=20),
    st.binary(max_size=12),
    st.integers(-(10**20), 10**20).map(str),
    st.floats().map(repr),  # nan, inf, -0.0, 1e+300, ...
    st.sampled_from(
        [
            "",
            " ",
            "99999999999999999999",
            "{",
            "{}",
            "[]",
            "prefill",
            "a|b",
            "x" * 129,
        ]
    ),
)


def spec_json(instance_id: str) -> str:
    """A valid stored spec for an id (what InstanceSpec.to_json writes)."""
    return InstanceSpec(id=instance_id, url="http://127.0.0.1:9", decode_ms_per_token=1.0).to_json()


# Carried first-token marks and releases: m, then m pairs {op, rid} (lua/carry.lua).
block_hash = st.text("0123456789abcdef", min_size=1, max_size=16)
# A prefix record (lua/_lib.lua carried_records): stem, max_owners, k, k pairs.
record = st.tuples(
    st.builds(lambda i, e: f"{i}#{e}", st.sampled_from(INSTANCES) | ids, st.integers(0, 9)),
    st.integers(1, 64).map(str),
    st.lists(st.tuples(block_hash, st.integers(0, 9).map(str)), min_size=1, max_size=5),
).map(lambda r: [r[0], r[1], str(len(r[2])), *(x for pair in r[2] for x in pair)])
# Held marks and releases, then (or not) at most 2 records: a reply's items after the
# transitions' 4 each are then 1 or 2 counts, never a multiple of 4 (changed_nothing).
transitions = st.tuples(
    st.lists(st.tuples(st.sampled_from(["f", "r"]), rids), max_size=3),
    st.none() | st.lists(record, max_size=2),
).map(
    lambda t: [
        str(len(t[0])),
        *(x for pair in t[0] for x in pair),
        *([] if t[1] is None else [str(len(t[1])), *(x for r in t[1] for x in r)]),
    ]
)

# Per script: the ARGV positions, each a strategy of valid values (see each header).
LAYOUTS: dict[str, list[Any]] = {
    "read_state": [flags],
    "read_specs": [since, st.just("") | st.just("0") | since, st.integers(1, 1000).map(str)],
    "sweep": [st.integers(1, 5000).map(str)],
    "mark_first_token": [rids],
    "release": [rids],
    "heartbeat": [ids, hint, hint, hint],
    "unregister": [ids],
    "renew_lease": [ids, st.integers(1, 86_400_000).map(str), ids],
    "reap_node": [ids, flags, st.integers(1, 5000).map(str)],
    "restore": [rids, ids, ids, st.integers(0, 3).map(str), phases, tokens, tokens, ms, ms],
    "record_outcome": [
        ids,
        st.sampled_from(["ok", "fail", "rate", "cordon", "uncordon"]),
        st.integers(1, 10).map(str),
        st.integers(1, 86_400_000).map(str),
        st.integers(1, 1000).map(str),
        st.integers(1000, 86_400_000).map(str),
        st.floats(0, 100).map(repr),
        ms,
        st.text(max_size=80),
    ],
    "read_outliers": [],
    "store_hints": [ids, hint, hint, hint],
    "merge_timing": [
        st.integers(1, 86_400_000).map(str),
        st.floats(0, 100).map(repr),
        st.integers(1, 86_400_000).map(str),
        st.sampled_from(["", "0", "17"]),
        ids,
        st.builds(lambda epoch: pack(_timing_batch(epoch)), st.integers(0, 4)),
    ],
}


def _timing_batch(epoch: int) -> list[float]:
    batch = empty_record(epoch, 2)
    add_sample(batch, 0, 500, 120.0)
    add_sample(batch, 1, 4, 20.0)
    return batch


@dataclass
class Call:
    """One script call and whether any argument was mutated away from its header."""

    name: str
    args: list[Any]
    mutated: bool


@st.composite
def mutate(draw: st.DrawFn, name: str, args: list[Any]) -> Call:
    """Keep the arguments, or replace a few with junk, or drop or add some."""
    mode = draw(st.sampled_from(["valid", "valid", "junk", "junk", "fewer", "more"]))
    out = list(args)
    if mode == "junk" and out:
        positions = st.integers(0, len(out) - 1)
        for i in draw(st.lists(positions, min_size=1, max_size=3, unique=True)):
            out[i] = draw(junk)
    elif mode == "fewer" and out:
        out = out[: draw(st.integers(0, len(out) - 1))]
    elif mode == "more":
        out += draw(st.lists(junk, min_size=1, max_size=3))
    return Call(name, out, mode != "valid")


@st.composite
def calls(draw: st.DrawFn, name: str) -> Call:
    """A call of one script: valid arguments by its header, then mutated or not."""
    if name == "register":
        instance_id = draw(ids)
        spec = draw(st.sampled_from([spec_json(instance_id), spec_json(instance_id)]) | junk)
        epoch = draw(st.integers(0, 4).map(str))
        args = [instance_id, spec, draw(st.integers(0, 1_000_000).map(str)), epoch]
        call = draw(mutate(name, args))
        # A spec other than the stored form of this very id is a mutation.
        call.mutated = call.mutated or spec != spec_json(instance_id)
        return call
    if name == "reserve":
        n = draw(st.integers(1, 3))
        args = [
            draw(rids),
            draw(ids),
            draw(tokens),
            draw(tokens),
            draw(flags),
            draw(flags),
            draw(counts),
            draw(st.sampled_from(["0", "600000"])),
            draw(st.just("") | run_ids),
            str(n),
            str(draw(st.integers(0, n))),
            draw(st.just("") | run_ids),
        ]
        for _ in range(n):
            candidate = draw(st.sampled_from(INSTANCES) | ids)
            free_at = draw(st.sampled_from([0, 1, 4398046511103]) | st.integers(0, 86_400_000))
            bounds = pack_candidate(
                draw(st.integers(-1, len(INSTANCES))),
                *(draw(st.integers(0, 86_400_000)) for _ in range(2)),
                *(draw(st.integers(0, 10**15)) for _ in range(2)),
                free_at,
            )
            args += [candidate, bounds.decode("ascii")]
        if draw(st.booleans()):
            args += draw(transitions)
        return draw(mutate(name, args))
    if name == "carry":
        return draw(mutate(name, draw(transitions)))
    args = [draw(position) for position in LAYOUTS[name]]
    return draw(mutate(name, args))


# ---------------------------------------------------------------------- pool


@dataclass
class Pool:
    """The coordinator whose pool the fuzz works in, and a raw client for dumps."""

    coordinator: Coordinator
    raw: Redis


async def dump(pool: Pool) -> dict[str, Any]:
    """Every key of the pool and its full content."""
    client = pool.raw
    keys = sorted([k async for k in client.scan_iter(match=pool.coordinator.keys.pattern())])
    if not keys:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        types = await pipe.execute()
    async with client.pipeline(transaction=False) as pipe:
        for key, kind in zip(keys, types, strict=True):
            if kind == b"hash":
                pipe.hgetall(key)
            elif kind == b"zset":
                pipe.zrange(key, 0, -1, withscores=True)
            elif kind == b"set":
                pipe.smembers(key)
            else:
                pipe.dump(key)
        values = await pipe.execute()
    return {key: (kind, value) for key, kind, value in zip(keys, types, values, strict=True)}


async def reset(pool: Pool) -> None:
    """Rebuild the baseline: two instances, a prefill and a decode reservation, a lease."""
    c = pool.coordinator
    await delete_pool(pool.raw, c.settings.key_prefix, c.pool)
    # The node starts over too: what it held went with the pool, not to a reaper.
    c._local.clear()
    c._pending_releases.clear()
    c._leased = False
    c._cache.run_id = ""  # a new run, not a lost one
    await c.renew_lease()
    timing = {"prefill_ms_per_token": 0.1, "prefill_overhead_ms": 5.0, "decode_ms_per_token": 2.0}
    await c.register_instance(InstanceSpec(id="i0", url="http://127.0.0.1:9", **timing))
    await c.register_instance(InstanceSpec(id="i1", url="http://127.0.0.1:9", max_slots=2))
    await c.reserve(100, 10, "round_robin", rid=PREFILL_RID)
    await c.reserve(100, 10, "round_robin", rid=DECODE_RID)
    await c.mark_first_token(DECODE_RID)


@pytest.fixture
async def lua_pool(redis_url: str, pool: str) -> AsyncIterator[Pool]:
    coordinator = Coordinator(
        connect_redis(redis_url, SETTINGS), pool=pool, node_id=NODE, settings=SETTINGS
    )
    raw = Redis.from_url(redis_url)  # bytes: a dump must not choke on what a script stored
    try:
        yield Pool(coordinator, raw)
    finally:
        await delete_pool(raw, SETTINGS.key_prefix, pool)
        await raw.aclose()
        await coordinator.close()


def extra_keys(c: Coordinator, call: Call) -> list[str]:
    """KEYS[22..] where the header names them (a node's reservation set, ...)."""
    if call.name == "reap_node":
        node = call.args[0] if call.args and isinstance(call.args[0], str) else NODE
        return [c.keys.node_rids(node if ID_RE.match(node) else NODE)]
    if call.name in ("reserve", "carry"):  # and the index records ride into
        return [c.keys.node_rids(NODE), c.keys.prefix_index()]
    if call.name == "renew_lease":
        return [c.keys.node_owner(NODE)]
    if call.name in ("release", "restore"):
        return [c.keys.node_rids(NODE)]
    if call.name in ("record_outcome", "unregister"):
        return [c.keys.outliers(), c.keys.ejected()]
    if call.name == "read_outliers":
        return [c.keys.outliers()]
    if call.name == "merge_timing":
        return [c.keys.timing()]
    if call.name == "register":
        return [c.keys.prefix_index()]
    return []


def changed_nothing(name: str, reply: Any) -> bool:
    """Whether a successful reply says the call wrote nothing."""
    if name in ("read_state", "read_specs", "read_outliers"):
        return True
    status = reply[0] if isinstance(reply, list) and reply else None
    if name == "reserve" and (
        len(reply[-2]) % 4 or any(as_text(s) == "ok" for s in reply[-2][::4])
    ):
        return False  # a carried transition or record took place, whatever the reservation did
    if name == "carry":  # records' counts follow the transitions' 4 items each
        return len(reply) % 4 == 0 and all(as_text(s) == "noop" for s in reply[::4])
    return (name, status) in {
        ("mark_first_token", "noop"),
        ("release", "noop"),
        ("reserve", "dup"),
        ("reserve", "stale"),
        ("reserve", "none"),
        ("reserve", "full"),
        ("reserve", "nolease"),
        ("restore", "nolease"),
        ("reap_node", "alive"),
        ("restore", "void"),
        ("restore", "exists"),
        ("record_outcome", "unknown"),
    }


ALLOWED_ERRORS = {
    "heartbeat": (UnknownInstanceError,),
    "unregister": (UnknownInstanceError,),
    "register": (EpochFencedError,),
    "store_hints": (UnknownInstanceError,),
}


def record(what: str) -> None:
    """Count an outcome in hypothesis' statistics (outside a fuzz: nothing)."""
    with contextlib.suppress(InvalidArgument):
        event(what)


async def check(pool: Pool, call: Call) -> None:
    """Run one call and check the properties in the module docstring."""
    c = pool.coordinator
    await reset(pool)
    before = await dump(pool)
    keys = [*c.keys.columns, *extra_keys(c, call)]
    try:
        reply = await c.scripts[call.name](keys=keys, args=call.args)
    except ResponseError as exc:
        mapped = from_response_error(exc)
        assert mapped is not None, f"{call}: raw Redis error {exc}"
        record(f"{call.name}: {type(mapped).__name__}")
        allowed = (ScriptArgumentError, *ALLOWED_ERRORS.get(call.name, ()))
        assert isinstance(mapped, allowed), f"{call}: {mapped!r}"
        if isinstance(mapped, ScriptArgumentError):
            assert call.mutated, f"{call}: valid arguments refused: {mapped}"
            detail = str(mapped).removeprefix("invalid script argument: ")
            assert detail and detail != str(mapped), str(mapped)
        assert await dump(pool) == before, f"{call}: a refused call wrote"
        return
    status = reply[0] if isinstance(reply, list) and reply else reply
    record(f"{call.name}: {status if not call.name.startswith('read_') else 'ok'}")
    if changed_nothing(call.name, reply):
        assert await dump(pool) == before, f"{call}: a call that changed nothing wrote"
    fresh = Coordinator(c.redis, pool=c.pool, node_id="reader", settings=SETTINGS)
    await fresh.refresh()  # a fresh node decodes every row
    await assert_counters_match_reservations(c)


# One valid call per script (by its header), for the position-by-position sweep.
BASE_CALLS: dict[str, list[str]] = {
    "read_state": ["1"],
    "read_specs": ["0", "", "500"],
    "sweep": ["500"],
    "reserve": [
        *("r-new", NODE, "100", "10", "1", "1", "600000", "0", "", "1", "0", ""),
        *("i0", pack_candidate(-1, 15, 20, 0, 0, 0).decode("ascii")),
        *("1", "f", PREFILL_RID),  # one carried first-token mark
    ],
    "mark_first_token": [PREFILL_RID],
    "release": [PREFILL_RID],
    "carry": [
        "2",
        "f",
        PREFILL_RID,
        "r",
        PREFILL_RID,
        "1",
        "i0#1",
        "8",
        "2",
        "0a1b",
        "1",
        "ff00",
        "0",
    ],
    "register": ["i0", spec_json("i0"), "0", "0"],
    "heartbeat": ["i0", "1.5", "", "2"],
    "unregister": ["i1"],
    "renew_lease": [NODE, "600000", "p0"],
    "reap_node": ["n0", "0", "500"],
    "restore": ["r-new", NODE, "i0", "1", "prefill", "100", "10", "15", "20"],
    "record_outcome": ["i0", "fail", "1", "10000", "100", "1000", "50", "10000", "status_500"],
    "read_outliers": [],
    "store_hints": ["i0", "1.5", "", "2"],
    "merge_timing": ["10000", "4.0", "86400000", "0", "i0", pack(_timing_batch(1))],
}
SWEEP_VALUES = [
    *("-0", "-0.0", "-1", "0x10", " 5", "1e3", "1.5", "nan", "inf", "", "{", "x" * 129),
    "18446744073709551616",  # 2^64: digits only, yet no SCAN cursor
]


@pytest.mark.parametrize("name", SCRIPT_NAMES)
async def test_odd_values_in_every_position(lua_pool: Pool, name: str) -> None:
    """Deterministic sweep: each odd value in each position, and every shorter ARGV."""
    base = BASE_CALLS[name]
    await check(lua_pool, Call(name, base, mutated=False))
    for i in range(len(base)):
        for value in SWEEP_VALUES:
            await check(lua_pool, Call(name, [*base[:i], value, *base[i + 1 :]], mutated=True))
    for n in range(len(base)):
        await check(lua_pool, Call(name, base[:n], mutated=True))


@settings(
    max_examples=EXAMPLES * len(SCRIPT_NAMES),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=st.sampled_from(SCRIPT_NAMES).flatmap(calls))
async def test_script_argv_fuzz(lua_pool: Pool, call: Call) -> None:
    await check(lua_pool, call)


async def test_reads_of_an_existing_pool_write_nothing(lua_pool: Pool) -> None:
    await reset(lua_pool)
    before = await dump(lua_pool)
    c = lua_pool.coordinator
    for name, args in (
        ("read_state", ["0"]),
        ("read_state", ["1"]),
        ("read_specs", ["0", "", "1"]),
        ("read_specs", ["999999", "", "10"]),
        ("read_specs", ["0", "0", "1000"]),
    ):
        await c.scripts[name](keys=c.keys.columns, args=args)
    assert await dump(lua_pool) == before
