"""Replaying recorded script calls as a node sends them (bench/scaling.py,
bench/instructions.py): `read_state` is a transaction of its script and the GETs of
`state` and `live` after it (Coordinator._read_state), so a replay sends those GETs
too and keeps one reply per recorded call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from coordinator.coordinator import read_state_gets


def queue_call(pipe: Any, sha: str, name: str, keys: Sequence[Any], args: Sequence[Any]) -> None:
    """Queue one recorded script call on `pipe` (read_state with its GETs)."""
    if name == "read_state":
        pipe.evalsha(sha, len(keys), *keys)
        for key in read_state_gets(list(keys), list(args)):
            pipe.get(key)
    else:
        pipe.evalsha(sha, len(keys), *keys, *args)


def call_replies(
    calls: Iterable[tuple[str, Sequence[Any], Sequence[Any]]], replies: Sequence[Any]
) -> list[Any]:
    """One reply per call, of the replies its queue_call commands got (read_state's
    GETs dropped)."""
    answers = iter(replies)
    out = []
    for name, keys, args in calls:
        out.append(next(answers))
        if name == "read_state":
            for _ in read_state_gets(list(keys), list(args)):
                next(answers)
    return out


def send_calls(
    client: Any, sha: Mapping[str, str], calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]
) -> list[Any]:
    """Send recorded calls in one pipeline (no transaction, errors returned as
    replies); one reply per call."""
    pipe = client.pipeline(transaction=False)
    for name, keys, args in calls:
        queue_call(pipe, sha[name], name, keys, args)
    return call_replies(calls, pipe.execute(raise_on_error=False))
