"""Judging relayed responses (passive health) and learning their output lengths."""

from __future__ import annotations

import json
import zlib
from typing import Any

USAGE_TAIL_BYTES = 16 * 1024  # stream tail kept to find the final `usage` chunk
KEEP_JSON_BYTES = 1024 * 1024  # non-streaming bodies up to this size are parsed for usage
DATA, DONE = b"data:", b"[DONE]"  # an SSE event's field, and the stream's last event
TAIL_LINES = 8  # lines at a stream's end looked at for its last events
DECODED_BYTES = 16 * 1024 * 1024  # a compressed answer is looked into up to this size
# Content-Encodings looked through (zlib reads gzip and zlib-wrapped deflate); the
# node passes any other through unjudged, as it does an answer past DECODED_BYTES.
ZLIB_ENCODINGS = frozenset({"gzip", "x-gzip", "deflate"})


class OutputCounter:
    """Observes a successful response: whether it is whole, and its output length.

    A compressed answer (the client asked for one, and the engine or a gateway in
    front of it compressed) is looked at decoded: read as it came, every gzip answer
    was a broken body, a failure of a healthy engine for passive health.
    """

    def __init__(self, stream: bool, encoding: str = "") -> None:
        self.stream = stream
        self.events = 0
        self.done_events = 0
        self.tail = b""
        self.body = bytearray()
        # Not looked into, so not judged: too large, compressed in a way zlib does not
        # read (br, zstd, raw deflate), or not the encoding it said it was.
        self.overflow = False
        self._decoded = 0
        self._inflate: Any = None
        encoding = encoding.strip().lower()
        if encoding in ZLIB_ENCODINGS:
            self._inflate = zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib header
        elif encoding not in ("", "identity"):
            self.overflow = True

    def feed(self, chunk: bytes) -> None:
        """Take one relayed chunk."""
        if self.overflow:
            return
        if self._inflate is not None:
            try:  # at most what is left of the budget, so a small bomb stays small
                chunk = self._inflate.decompress(chunk, DECODED_BYTES - self._decoded + 1)
            except zlib.error:
                self.overflow = True
                return
            self._decoded += len(chunk)
            if self._decoded > DECODED_BYTES:
                self.overflow = True
                self.tail, self.body = b"", bytearray()
                return
        if self.stream:
            # A marker split across two network chunks is counted in the one it ends in:
            # the previous chunk's last bytes, too few to hold a whole marker, go first.
            # (Counted per chunk alone, a `[DONE]` split in two made a whole answer a
            # truncated stream: a failure of a healthy engine for passive health.)
            self.events += (self.tail[-len(DATA) + 1 :] + chunk).count(DATA)
            self.done_events += (self.tail[-len(DONE) + 1 :] + chunk).count(DONE)
            self.tail = (self.tail + chunk)[-USAGE_TAIL_BYTES:]
        else:
            self.body += chunk
            if len(self.body) > KEEP_JSON_BYTES:
                self.overflow = True
                self.body.clear()

    def problem(self) -> str | None:
        """Why a 2xx answer looks broken, or None (passive health): a stream whose last
        event is not `[DONE]` (cut or empty; the last event, not any: a model's text
        may say `[DONE]` too), or whose event before it is an error (an engine that
        failed mid-generation, as vLLM and SGLang report it); a non-streaming body that
        is not JSON."""
        if self.overflow:
            return None
        if self.stream:
            events = [
                line[len(DATA) :].strip()
                for line in self.tail.rstrip().rsplit(b"\n", TAIL_LINES)[-TAIL_LINES:]
                if line.startswith(DATA)
            ]
            if not events or events[-1] != DONE:
                return "truncated_stream" if self.events else "empty_stream"
            if len(events) > 1 and _is_error(events[-2]):
                return "error_event"
            return None
        try:
            json.loads(self.body)
        except (ValueError, RecursionError):
            return "malformed_response"
        return None

    def tokens(self) -> int | None:
        """usage.completion_tokens when the engine sent it, else the count of SSE chunks."""
        if self.overflow:
            return None
        if self.stream:
            for line in reversed(self.tail.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and b'"usage"' in line:
                    usage = _completion_tokens(line[5:])
                    if usage is not None:
                        return usage
            return max(0, self.events - self.done_events) or None
        return _completion_tokens(bytes(self.body))


def _is_error(raw: bytes) -> bool:
    """Whether an event's data is an error object: {"error": ...} (OpenAI, SGLang,
    recent vLLM) or {"object": "error", ...} (earlier vLLM)."""
    if not raw.startswith(b"{") or b"error" not in raw:
        return False  # most events: no parse
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and (
        doc.get("error") not in (None, "", {}) or doc.get("object") == "error"
    )


def _completion_tokens(raw: bytes) -> int | None:
    try:
        doc: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
