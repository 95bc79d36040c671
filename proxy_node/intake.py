"""What the node needs from a completion request body, or why it refuses it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.coordinator import MAX_TOKENS
from coordinator.tokens import max_output_tokens_of, prompt_tokens_of


class RequestRejectedError(Exception):
    """The body cannot be served; carries the HTTP status and error code to answer."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


# Body fields the node itself reads (for the reservation's expected output). Only
# these are checked; the rest of the body goes to the engine byte for byte.
OUTPUT_CAPS = ("max_tokens", "max_completion_tokens")


def _check_output_cap(name: str, value: object) -> None:
    """An output cap must be absent, null (OpenAI: the engine's default) or 1..MAX_TOKENS."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        shown = repr(value) if not isinstance(value, int) or value < 10**12 else "a huge integer"
        raise RequestRejectedError(
            400,
            f"{name} must be an integer in 1..{MAX_TOKENS} or null, got {shown}",
            "invalid_max_tokens",
        )


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """The sizes a reservation needs, and whether the client asked for a stream."""

    prompt_tokens: int
    expected_output_tokens: int
    stream: bool
    prefix_hashes: list[str]  # salted prefix block hashes (coordinator/prefix.py)
    model: str | None = field(default=None, compare=False)  # the body's model, when a string
    output_cap: int | None = field(default=None, compare=False)  # max_tokens, when given


def parse_completion(
    raw: bytes,
    prompt_tokens_header: str | None,
    default_output_tokens: int,
    prefix_hashes: Callable[[dict[str, Any]], list[str]] = lambda body: [],
) -> CompletionRequest:
    """Check a chat/completion body; raises RequestRejectedError (400) when unusable.

    The prompt size comes from `X-Prompt-Tokens` when the client sends it (it may know
    the exact count), else from the shared chars/4 rule. The expected output is the
    client's cap, else `default_output_tokens` (the pool's learned output length).
    `prefix_hashes` turns the body into its prefix block hashes (none by default).
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestRejectedError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestRejectedError(400, "the request body must be a JSON object", "invalid_body")
    if prompt_tokens_header is not None:
        try:
            prompt = int(prompt_tokens_header)
        except ValueError:
            prompt = -1
        if not 0 <= prompt <= MAX_TOKENS:
            raise RequestRejectedError(
                400, f"X-Prompt-Tokens must be an integer in 0..{MAX_TOKENS}", "invalid_header"
            )
    else:
        prompt = min(prompt_tokens_of(body), MAX_TOKENS)
    for name in OUTPUT_CAPS:
        _check_output_cap(name, body.get(name))
    cap = max_output_tokens_of(body)
    expected = min(cap if cap is not None else default_output_tokens, MAX_TOKENS)
    model = body.get("model")
    return CompletionRequest(
        prompt,
        expected,
        body.get("stream") is True,
        prefix_hashes(body),
        model if isinstance(model, str) else None,
        cap,
    )
