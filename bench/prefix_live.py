"""Two live measurements of prefix affinity for bench/prefix_report.py.

- `follow_up_turns`: multi-turn chats through a local cluster whose nodes run the
  default configuration (affinity on) and whose mock engines keep a prefix cache:
  how often a follow-up turn lands on its previous turn's instance, and how evenly
  the instances are loaded.
- `redis_cost`: Redis CPU per request of the prefix index (the decision's `HMGET`,
  and the record that rides along with the node's next call), from `INFO
  commandstats` of a private server whose index is full, at several pool sizes; and
  the same commands replayed in pipelines (a busy shard, which never idles between
  calls).
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from redis.asyncio import Redis

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.prefix import block_hashes, salt_key

SYSTEM_WORDS = ("fleet", "engine", "prefix", "cache", "token", "block", "route", "queue")


@dataclass(frozen=True, slots=True)
class TurnsResult:
    """Where the turns of the conversations went."""

    conversations: int
    turns: int
    follow_ups: int  # turns after the first of their conversation
    same_instance: int  # follow-ups served by their previous turn's instance
    per_instance: dict[str, int]  # instances that served none are absent
    failed: int
    instances: int  # in the fleet, idle or not

    @property
    def stickiness(self) -> float:
        """Share of follow-up turns on their previous turn's instance."""
        return self.same_instance / self.follow_ups if self.follow_ups else float("nan")

    @property
    def busiest_over_mean(self) -> float:
        """Requests of the busiest instance / the mean over the fleet's instances
        (those that served nothing count, with 0)."""
        counts = list(self.per_instance.values())
        return max(counts) / (sum(counts) / self.instances) if counts else float("nan")

    @property
    def counts_text(self) -> str:
        """Requests per instance, idle instances as 0s."""
        idle = [0] * max(0, self.instances - len(self.per_instance))
        return " / ".join(map(str, [*self.per_instance.values(), *idle]))


def _system_prompt(rng: random.Random, chars: int) -> str:
    words = [rng.choice(SYSTEM_WORDS) for _ in range(chars // 5)]
    return " ".join(words)[:chars]


async def _conversation(
    session: aiohttp.ClientSession,
    urls: list[str],
    index: int,
    turns: int,
    system: str,
    think_s: float,
    seen: list[tuple[int, int, str]],
) -> int:
    """One conversation, turn after turn, each through the next node; failures."""
    rng = random.Random(index)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    failed = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} of chat {index}: " * 20})
        url = urls[(index + turn) % len(urls)] + "/v1/chat/completions"
        body = {"model": "mock", "messages": messages, "max_tokens": 32}
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                failed += 1
                continue
            answer = (await resp.json())["choices"][0]["message"]["content"]
            seen.append((index, turn, resp.headers["X-Instance-Id"]))
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
    return failed


async def follow_up_turns(
    node_urls: list[str],
    instances: int,
    *,
    conversations: int = 24,
    turns: int = 4,
    system_chars: int = 16_000,
    shared_system: bool = False,
    think_s: float = 1.0,
) -> TurnsResult:
    """Run the conversations concurrently (staggered starts); where did the turns go.

    Each conversation has a system prompt of its own, or with `shared_system` all have
    the same one (a popular prefix: every first turn finds it cached somewhere)."""
    seen: list[tuple[int, int, str]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def started(i: int) -> int:
            await asyncio.sleep(i * think_s / 4)
            rng = random.Random(-1 if shared_system else i)
            system = _system_prompt(rng, system_chars)
            return await _conversation(session, node_urls, i, turns, system, think_s, seen)

        failures = await asyncio.gather(*(started(i) for i in range(conversations)))
    where = {(c, t): iid for c, t, iid in seen}
    follow = [(c, t) for c, t in where if t > 0 and (c, t - 1) in where]
    same = sum(1 for c, t in follow if where[(c, t)] == where[(c, t - 1)])
    return TurnsResult(
        conversations,
        turns,
        len(follow),
        same,
        dict(sorted(Counter(where.values()).items())),
        sum(failures),
        instances,
    )


@dataclass(frozen=True, slots=True)
class CostResult:
    """Redis CPU per request of the prefix index at one pool size (µs)."""

    instances: int
    case: str  # what the requests are
    lookup_us: float  # one lookup: an HMGET of the blocks and one of their owners' counts
    record_us: float  # one record: what carrying it adds to a call, and a share of
    # sampled reclaims
    records_per_request: float  # a request whose blocks were all held records nothing
    cpu_us: float = float("nan")  # server main-thread CPU per request (lookup and record,
    # network included): what a preempted server's wall-clock usec_per_call leaves out
    replayed_cpu_us: float = float("nan")  # the same, for the same commands replayed in
    # pipelines from the state they started from: the server never waits between them

    @property
    def total_us(self) -> float:
        """What the index adds to a request's Redis work."""
        return self.lookup_us + self.record_us * self.records_per_request


def _held_text(instance: int, k: int, blocks: int, chars: int) -> str:
    """Text of conversation k of an instance, `blocks` blocks long (a longer one
    extends a shorter one, as a follow-up turn does)."""
    return f"{instance}:{k}:" + "x" * (chars * blocks)


async def _cpu_s(redis: Redis) -> float:
    """CPU seconds of the server's main thread so far."""
    cpu = await redis.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


# Commands a sampled reclaim runs outside any script (coordinator/prefix_index.py).
# the sample: HSCAN, or HRANDFIELD in trees before 2026-12-05 (--against)
RECLAIM_ROWS = (
    "cmdstat_hscan",
    "cmdstat_hrandfield",
    "cmdstat_hdel",
    "cmdstat_hsetnx",
    "cmdstat_unlink",
)


def _usec(commandstats: dict[str, Any]) -> float:
    """The server's time in every command of an `INFO commandstats` reply (µs) but the
    bench's own INFO and CONFIG RESETSTAT."""
    return sum(
        float(row["usec"])
        for name, row in commandstats.items()
        if not name.startswith(("cmdstat_info", "cmdstat_config"))
    )


class CommandLog:
    """The commands one asyncio client sends while `on` (its pipelines' included, as
    queued), to replay them later (`replayed_cpu_us`)."""

    def __init__(self, redis: Redis) -> None:
        self.on = False
        self.commands: list[tuple[Any, ...]] = []
        send: Callable[..., Awaitable[Any]] = redis.execute_command
        pipeline = redis.pipeline

        async def logged(*args: Any, **options: Any) -> Any:
            if self.on:
                self.commands.append(args)
            return await send(*args, **options)

        def logged_pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            async def logged_execute(*a: Any, **k: Any) -> Any:
                if self.on:
                    self.commands += [command for command, _ in pipe.command_stack]
                return await execute(*a, **k)

            pipe.execute = logged_execute  # type: ignore[method-assign]
            return pipe

        redis.execute_command = logged  # type: ignore[method-assign]
        redis.pipeline = logged_pipeline  # type: ignore[method-assign]


async def replayed_cpu_us(
    redis: Redis, pattern: str, start: dict[bytes, bytes], commands: list[tuple[Any, ...]],
    requests: int, batch: int = 500, repeats: int = 5,
) -> float:  # fmt: skip
    """Server main-thread CPU per request (µs) of `commands` sent again in pipelines of
    `batch` onto the pool as it was when they were first sent (`start`: its keys
    DUMPed): the same work without a wait for each reply, as a busy shard does it.
    The median of `repeats` replays, each from `start` (a replay of a thousand
    requests takes a few ms of CPU, which the kernel counts in ticks). The pool ends
    as the first run left it, but for the seconds the records stamp."""
    found = [k async for k in redis.scan_iter(match=pattern, count=1000)]
    runs = []
    for _ in range(repeats):
        if found:
            await redis.delete(*found)
        for key, payload in start.items():
            await redis.restore(key, 0, payload, replace=True)
        cpu = await _cpu_s(redis)
        for at in range(0, len(commands), batch):
            pipe = redis.pipeline(transaction=False)
            for command in commands[at : at + batch]:
                pipe.execute_command(*command)
            await pipe.execute()
        runs.append((await _cpu_s(redis) - cpu) * 1e6 / requests)
        found = [k async for k in redis.scan_iter(match=pattern, count=1000)]
    return statistics.median(runs)


async def _dump(redis: Redis, pattern: str) -> dict[bytes, bytes]:
    """Every key of the pattern, DUMPed."""
    keys = [k async for k in redis.scan_iter(match=pattern, count=1000)]
    return {k: v for k in keys if (v := await redis.dump(k)) is not None}


async def redis_cost(
    redis_url: str,
    instances: int,
    *,
    blocks: int = 30,
    added: int = 2,
    requests: int = 1000,
    capacity_tokens: int = 100_000,
    seed: int = 0,
    chunk: int = 100,
) -> list[CostResult]:
    """Fill every instance's index to capacity with `blocks`-block conversations, then
    time what a node does per request: the lookup, and the record on the instance it
    chose, for follow-up turns (`added` new blocks on a held conversation, sent to
    its holder) and for new prompts (`blocks` blocks nobody holds).

    A record rides along with the node's next call (`reserve`, or `carry` when none
    comes: coordinator/held_records.py), so its cost is what carrying it adds to a
    call the node makes anyway: each record goes in a `carry` call of its own, and the
    same number of empty `carry` calls, timed in a pass of their own, is taken off.
    (A tree from before records rode along sends its `record_prefix` script: its whole
    cost counts.) The lookup is timed in a pass of its own over the same requests.
    Each figure is the median over chunks of `chunk` requests, so that a moment the
    server is descheduled on a busy machine moves one chunk, not the result. The
    lookups and records of each case, and the empty calls, are then sent again in
    pipelines from the state they started from (`replayed_cpu_us`).
    """
    pool = f"cost-{instances}-{random.Random(seed).getrandbits(32):08x}"
    # carry_ms 0: a record goes at once, in a call of its own
    settings = Settings(prefix_cache_tokens=capacity_tokens, carry_ms=0)
    chars = settings.prefix_block_chars
    redis = Redis.from_url(redis_url)
    log = CommandLog(redis)
    coordinator = Coordinator(redis, pool=pool, node_id="cost", settings=settings)
    carried = hasattr(coordinator, "hold_record")  # records ride along (this design)
    pattern = coordinator.keys.pattern()
    prefix = coordinator.prefix
    key = salt_key(pool, "")
    out = []
    try:
        for i in range(instances):
            await coordinator.register_instance(
                InstanceSpec(id=f"i{i}", url=f"http://127.0.0.1:{9000 + i}")
            )
        await coordinator.refresh()
        held_each = capacity_tokens // prefix.block_tokens // blocks
        for i in range(instances):
            await asyncio.gather(
                *(
                    prefix.record(f"i{i}", block_hashes(_held_text(i, k, blocks, chars), key, chars, blocks))
                    for k in range(held_each)
                )
            )  # fmt: skip
        rng = random.Random(seed)
        fresh = held_each
        for case in (
            f"follow-up turn: +{added} blocks on a held {blocks}",
            f"new {blocks}-block prompt",
        ):
            batch = []
            for _ in range(requests):
                i = rng.randrange(instances)
                if case.startswith("new"):
                    fresh += 1
                    text, size = _held_text(i, fresh, blocks, chars), blocks
                else:
                    size = blocks + added
                    text = _held_text(i, rng.randrange(held_each), size, chars)
                batch.append((f"i{i}", block_hashes(text, key, chars, size)))
            lookups, records, cpus, calls = [], [], [], 0
            start_state, log.commands = await _dump(redis, pattern), []
            empty: list[tuple[Any, ...]] = []  # the empty calls' commands
            for start in range(0, requests, chunk):
                part = batch[start : start + chunk]
                await redis.config_resetstat()
                for _, hashes in part:
                    await prefix.cached_tokens(hashes)
                # plain commands only (an HMGET or two): the server's time in all of them
                lookups.append(_usec(await redis.info("commandstats")) / len(part))
                floor_us, floor_cpu = 0.0, 0.0
                if carried:
                    floor_us, floor_cpu = await _empty_calls(coordinator, len(part), log, empty)
                await redis.config_resetstat()
                cpu = await _cpu_s(redis)
                log.on = True
                for iid, hashes in part:
                    found = await prefix.cached_tokens(hashes)
                    await prefix.record(iid, hashes, found.get(iid, 0))
                log.on = False
                cpus.append((await _cpu_s(redis) - cpu) * 1e6 / len(part) - floor_cpu)
                stats = await redis.info("commandstats")
                # The record's call (less an empty one's), and the commands only sampled
                # reclaims send. Their HMGETs and HSETs (one record in 16) share rows
                # with the lookups' and are left out here; bench/instructions.py counts
                # everything.
                if "cmdstat_evalsha" in stats:
                    evalsha = stats["cmdstat_evalsha"]
                    reclaim = sum(float(stats[row]["usec"]) for row in RECLAIM_ROWS if row in stats)
                    per_call = (float(evalsha["usec"]) + reclaim) / int(evalsha["calls"])
                    records.append(per_call - floor_us)
                    calls += int(evalsha["calls"])
            replayed = await replayed_cpu_us(redis, pattern, start_state, log.commands, requests)
            if empty:
                replayed -= await replayed_cpu_us(redis, pattern, start_state, empty, requests)
            out.append(
                CostResult(
                    instances,
                    case,
                    statistics.median(lookups),
                    statistics.median(records) if records else 0.0,
                    calls / requests,
                    statistics.median(cpus),
                    replayed,
                )
            )
    finally:
        keys = [k async for k in redis.scan_iter(match=coordinator.keys.pattern(), count=1000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    return out


async def _empty_calls(
    coordinator: Any, n: int, log: CommandLog, commands: list[tuple[Any, ...]]
) -> tuple[float, float]:
    """Send `n` `carry` calls that carry nothing, one at a time as records go: the
    call a record rides on, which the node makes anyway. Returns the server's time in
    one (commandstats µs) and its main-thread CPU per call (µs); their commands are
    added to `commands`."""
    redis = coordinator.redis
    await redis.config_resetstat()
    cpu = await _cpu_s(redis)
    logged, log.commands, log.on = log.commands, [], True
    for _ in range(n):
        await coordinator._call("carry", [0], (coordinator._node_rids,))
    log.on = False
    commands += log.commands
    log.commands = logged
    cpu_us = (await _cpu_s(redis) - cpu) * 1e6 / n
    evalsha = (await redis.info("commandstats"))["cmdstat_evalsha"]
    return float(evalsha["usec"]) / int(evalsha["calls"]), cpu_us
