"""A loopback TCP proxy that can cut a connection path on command (for partition tests).

Modes:
- `pass`: bytes flow both ways.
- `drop`: every connection is closed and the listener stops, so new connects are
  refused, as from a host that went away.
- `blackhole`: connections are accepted and read, but nothing is forwarded or
  answered, as behind a firewall that silently discards packets. Connections that
  were blackholed are closed when the mode changes again: their bytes were lost, so
  the stream could never be resynchronised.
- `mute`: requests are forwarded and executed, but every reply is discarded: lost
  replies. Muted connections are closed when the mode changes again, like
  blackholed ones.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MODES = ("pass", "drop", "blackhole", "mute")
READ_BYTES = 65536


@dataclass(eq=False)
class _Link:
    """One client connection and, unless it was blackholed from the start, its upstream."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    blackholed: bool = False
    muted: bool = False  # forward requests, discard replies
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        """Close both sides at once (RST), dropping anything buffered."""
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()


class FaultProxy:
    """Listens on 127.0.0.1 and forwards to target_host:target_port (see the module doc)."""

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.mode = "pass"
        self.accepted = 0  # connections accepted since start
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    async def start(self) -> FaultProxy:
        """Start listening (a port of 0 picks a free one, kept across drop/pass)."""
        await self._listen()
        return self

    async def close(self) -> None:
        """Stop listening and close every connection."""
        await self._unlisten()
        for link in list(self._links):
            link.abort()
        current = asyncio.current_task()
        tasks = [t for link in self._links for t in link.tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task
        self._links.clear()

    async def set_mode(self, mode: str) -> None:
        """Switch to pass, drop or blackhole (see the module doc)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        previous, self.mode = self.mode, mode
        log.info("fault proxy %d: %s -> %s", self.port, previous, mode)
        if mode == "drop":
            await self._unlisten()
            for link in list(self._links):
                link.abort()
            return
        if mode in ("blackhole", "mute"):
            for link in self._links:
                if mode == "blackhole":
                    link.blackholed = True
                else:
                    link.muted = True
            if self._server is None:
                await self._listen()
            return
        for link in list(self._links):
            if link.blackholed or link.muted:
                link.abort()
        if self._server is None:
            await self._listen()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(writer, blackholed=self.mode in ("drop", "blackhole"))
        link.muted = self.mode == "mute"
        if self.mode == "drop":  # raced with the listener closing
            link.abort()
            return
        self._links.add(link)
        task = asyncio.current_task()
        if task is not None:
            link.tasks.append(task)
        try:
            if not link.blackholed:
                try:
                    up_reader, link.upstream = await asyncio.open_connection(
                        self.target_host, self.target_port
                    )
                except OSError:
                    link.abort()
                    return
                pump_back = asyncio.create_task(
                    self._pump(up_reader, link.client, link, reply=True)
                )
                link.tasks.append(pump_back)
                await self._pump(reader, link.upstream, link)
                await asyncio.wait([pump_back])
            else:
                await self._pump(reader, None, link)
        finally:
            link.abort()
            self._links.discard(link)

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter | None,
        link: _Link,
        *,
        reply: bool = False,
    ) -> None:
        """Copy bytes until EOF; a blackholed link reads and discards them, a muted one
        discards the replies only."""
        with suppress(ConnectionError, OSError):
            while True:
                data = await source.read(READ_BYTES)
                if not data:
                    break
                if link.blackholed or sink is None or (reply and link.muted):
                    continue
                sink.write(data)
                await sink.drain()
        # One side ended: end the other too, so neither end waits on a half-open link.
        if not link.blackholed:
            link.abort()
