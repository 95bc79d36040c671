"""One render of a costly view at a time, shared by the requests waiting for it:
/metrics, and per query /debug/instance_loads.

A render reads the pool from Redis (a whole `state` read and the outlier hash) and
writes every instance's series in a thread, which holds the GIL for 60 ms at 1,000
instances. /metrics is on the service plane, where any client reaches it: rendering
once per GET let a flood of scrapes multiply the node's Redis reads and starve its
event loop (docs/benchmarks.md, "A flood of /metrics scrapes").

Each scrape gets a render that started after the scrape arrived, so it never shows
state older than the request, and every scrape that arrives before a render starts
shares that render. Renders run one at a time, and the next one starts no sooner
than `pause_after` the previous one's end: `min_gap_s` (the most renders, so pool
reads, a second), and `idle_ratio` times the render's own length (the most of a core
a flood can take: 1 / (1 + idle_ratio)).

/debug/instance_loads (the control plane, whose reads need no token; the dashboard
asks every second per open tab) reads the pool and ranks it too: `SharedRenders`
keeps a `SharedRender` per query, and runs one of their renders at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

MIN_GAP_S = 0.05  # at most 20 renders a second, whatever the scrape rate
IDLE_RATIO = 3.0  # a flood of scrapes takes at most a quarter of a core
KEYS_KEPT = 16  # queries of a debug view whose renders are shared


def pause_after(
    render_s: float, min_gap_s: float = MIN_GAP_S, idle_ratio: float = IDLE_RATIO
) -> float:
    """How long after a render that took `render_s` the next one may start."""
    return max(min_gap_s, idle_ratio * render_s)


class SharedRender:
    """Serves scrapes from renders of `render`, at most one running at a time."""

    def __init__(
        self,
        render: Callable[[], Awaitable[bytes]],
        *,
        min_gap_s: float = MIN_GAP_S,
        idle_ratio: float = IDLE_RATIO,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._render = render
        self._min_gap_s = min_gap_s
        self._idle_ratio = idle_ratio
        self._clock = clock
        self._sleep = sleep
        self._lock = asyncio.Lock()  # FIFO: the waiters of one render take it in turn
        self.started = 0  # renders started so far
        self._done = 0  # the render whose body is kept (0: none yet)
        self._body = b""
        self._next_at = float("-inf")  # clock time before which no render starts

    async def get(self) -> bytes:
        """The body of a render that started after this call."""
        clock = self._clock or asyncio.get_running_loop().time
        wanted = self.started + 1
        async with self._lock:
            if self._done >= wanted:  # rendered while this scrape waited its turn
                return self._body
            wait = self._next_at - clock()
            if wait > 0:
                await self._sleep(wait)
            self.started += 1
            render = self.started
            began = clock()
            try:
                body = await self._render()
            finally:
                ended = clock()
                self._next_at = ended + pause_after(
                    ended - began, self._min_gap_s, self._idle_ratio
                )
            self._body, self._done = body, render
            return body


class SharedRenders:
    """A SharedRender per key (a view's query), the `size` most recently asked kept;
    one render of any of them runs at a time."""

    def __init__(self, size: int = KEYS_KEPT) -> None:
        self._size = size
        self._by_key: dict[Hashable, SharedRender] = {}  # least recently asked first
        self._running = asyncio.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    async def get(self, key: Hashable, render: Callable[[], Awaitable[bytes]]) -> bytes:
        """The body of a render for `key` that started after this call; `render` makes
        one when no SharedRender for `key` is kept."""
        shared = self._by_key.pop(key, None)
        if shared is None:

            async def one_at_a_time() -> bytes:
                async with self._running:
                    return await render()

            shared = SharedRender(one_at_a_time)
        self._by_key[key] = shared
        while len(self._by_key) > self._size:
            del self._by_key[next(iter(self._by_key))]
        return await shared.get()
