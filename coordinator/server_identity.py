"""Which Redis server process a client's connections reach: a restart or a failover
that the client followed without an error shows as another server `run_id`.

redis-py reconnects a pooled connection the server closed without telling anyone,
and a Sentinel client then asks the sentinels for the master again. A node idle
while Redis restarted from its persistence files, or failed over to a replica, would
go on with a server that lost its latest writes (a release, say, whose reservation
is then counted for good) and never re-assert. Each new connection therefore asks
`INFO server` for the process's `run_id`; a node that sees it change re-asserts
(Coordinator._call). Not for Redis Cluster, whose client connects to every shard:
there the first call after a failover fails, which degrades the node anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError


@dataclass(slots=True)
class ServerIdentity:
    """The server `run_id` a client's connections last reached, and how often it changed."""

    run_id: str | None = None
    changes: int = 0

    async def on_connect(self, connection: Any) -> None:
        """redis-py's `redis_connect_func`: the usual handshake, then `INFO server`.
        A server that refuses INFO (an ACL without `+info`, a renamed command) is
        not told apart: the node then relies on failed calls alone."""
        await connection.on_connect()
        try:
            await connection.send_command("INFO", "server")
            info = await connection.read_response()
        except ResponseError:
            return
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("run_id:"):
                self.saw(line[len("run_id:") :].strip())
                return

    def saw(self, run_id: str) -> None:
        """Note the run_id a new connection reached."""
        if self.run_id is not None and run_id != self.run_id:
            self.changes += 1
        self.run_id = run_id


def identity_of(client: Any) -> ServerIdentity | None:
    """The identity connect_redis attached to a client; None for other clients
    (Redis Cluster, fakeredis, a client built by hand)."""
    identity = getattr(client, "_coordinator_identity", None)
    return identity if isinstance(identity, ServerIdentity) else None
