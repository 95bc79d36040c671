"""One /metrics render at a time, shared by the scrapes waiting for it.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

MIN_GAP_S = 0.05  # at most 20 renders a second, whatever the scrape rate
IDLE_RATIO = 3.0  # a flood of scrapes takes at most a quarter of a core


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
        self._clock = clock or asyncio.get_running_loop().time
        self._sleep = sleep
        self._lock = asyncio.Lock()  # FIFO: the waiters of one render take it in turn
        self.started = 0  # renders started so far
        self._done = 0  # the render whose body is kept (0: none yet)
        self._body = b""
        self._next_at = float("-inf")  # clock time before which no render starts

    async def get(self) -> bytes:
        """The body of a render that started after this call."""
        wanted = self.started + 1
        async with self._lock:
            if self._done >= wanted:  # rendered while this scrape waited its turn
                return self._body
            wait = self._next_at - self._clock()
            if wait > 0:
                await self._sleep(wait)
            self.started += 1
            render = self.started
            began = self._clock()
            try:
                body = await self._render()
            finally:
                ended = self._clock()
                self._next_at = ended + pause_after(
                    ended - began, self._min_gap_s, self._idle_ratio
                )
            self._body, self._done = body, render
            return body
