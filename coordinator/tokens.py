"""The one token-estimation rule shared by the proxy node and the mock engine."""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4  # the common rule of thumb for English BPE vocabularies


def estimate_tokens(text: str) -> int:
    """ceil(characters / 4), at least 1 for non-empty text."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def content_text(content: Any) -> str:
    """The text of a message content: a string, or the `text` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text", ""), str)
        )
    return ""


def prompt_tokens_of(body: dict[str, Any]) -> int:
    """Prompt size of a chat or completion request body, by the chars/4 rule."""
    if "messages" in body and isinstance(body["messages"], list):
        text = "".join(
            content_text(m.get("content")) for m in body["messages"] if isinstance(m, dict)
        )
        return estimate_tokens(text)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return sum(estimate_tokens(p) for p in prompt if isinstance(p, str))
    return estimate_tokens(prompt) if isinstance(prompt, str) else 0


def max_output_tokens_of(body: dict[str, Any]) -> int | None:
    """The client's output cap (`max_completion_tokens` or `max_tokens`), if valid."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
