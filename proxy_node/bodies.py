"""Reading a bounded part of an engine's response body."""

from __future__ import annotations

import aiohttp


async def read_up_to(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The body's first `limit` bytes, or all of it when it is shorter.

    `StreamReader.read(n)` alone returns what has arrived so far, which for a body sent
    in several packets is its first part only: a large engine `/metrics` came back cut
    mid-line, and its parse failed.
    """
    parts: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await stream.read(limit - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)
