"""Learning output lengths from relayed responses (for the expected-output average)."""

from __future__ import annotations

import json
from typing import Any

USAGE_TAIL_BYTES = 16 * 1024  # stream tail kept to find the final `usage` chunk
KEEP_JSON_BYTES = 1024 * 1024  # non-streaming bodies up to this size are parsed for usage
DATA, DONE = b"data:", b"[DONE]"  # an SSE event's field, and the stream's last event


class OutputCounter:
    """Observes a successful response to learn its output length (for the average)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.events = 0
        self.done_events = 0
        self.tail = b""
        self.body = bytearray()
        self.overflow = False

    def feed(self, chunk: bytes) -> None:
        """Take one relayed chunk."""
        if self.stream:
            # A marker split across two network chunks is counted in the one it ends in:
            # the previous chunk's last bytes, too few to hold a whole marker, go first.
            # (Counted per chunk alone, a `[DONE]` split in two made a whole answer a
            # truncated stream: a failure of a healthy engine for passive health.)
            self.events += (self.tail[-len(DATA) + 1 :] + chunk).count(DATA)
            self.done_events += (self.tail[-len(DONE) + 1 :] + chunk).count(DONE)
            self.tail = (self.tail + chunk)[-USAGE_TAIL_BYTES:]
        elif not self.overflow:
            self.body += chunk
            if len(self.body) > KEEP_JSON_BYTES:
                self.overflow = True
                self.body.clear()

    def problem(self) -> str | None:
        """Why a 2xx answer looks broken, or None: a stream whose last event is not
        `[DONE]` (cut or empty), or a non-streaming body that is not JSON (passive
        health). The last event, not any: a model's text may say `[DONE]` too."""
        if self.stream:
            last = self.tail.rstrip().rpartition(b"\n")[2]
            if last.startswith(DATA) and last[len(DATA) :].strip() == DONE:
                return None
            return "truncated_stream" if self.events else "empty_stream"
        if self.overflow:
            return None  # too large to check; a body that long is an answer
        try:
            json.loads(self.body)
        except (ValueError, RecursionError):
            return "malformed_response"
        return None

    def tokens(self) -> int | None:
        """usage.completion_tokens when the engine sent it, else the count of SSE chunks."""
        if self.stream:
            for line in reversed(self.tail.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and b'"usage"' in line:
                    usage = _completion_tokens(line[5:])
                    if usage is not None:
                        return usage
            return max(0, self.events - self.done_events) or None
        return None if self.overflow else _completion_tokens(bytes(self.body))


def _completion_tokens(raw: bytes) -> int | None:
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
