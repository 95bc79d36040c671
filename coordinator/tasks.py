"""Background-loop hygiene: never outlive a cancellation, even a swallowed one.

On Python 3.11, `asyncio.wait_for` returns the inner result when the inner future
finished in the same loop iteration as an outer `cancel()` (CPython gh-86296, fixed
in 3.12), and redis-py wraps every socket write in `wait_for`. A loop that calls
Redis can therefore see its cancellation vanish: the task is left `cancelling()`
and loops on. Every long-running loop checks `raise_if_cancelling()` once per turn.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise CancelledError when the current task was asked to stop (even if it was swallowed)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[object] | asyncio.Task[None], repeat_s: float = 0.5) -> None:
    """Cancel a task and wait for it to end, cancelling again if a cancel got swallowed."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=repeat_s)
    if not task.cancelled():
        task.exception()  # retrieved: a failure of a stopped loop was logged by the loop
