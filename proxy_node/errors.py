"""OpenAI-style JSON error responses, and a middleware that gives aiohttp's own errors that shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

# status -> OpenAI-style error `type`
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_body(status: int, message: str, code: str) -> dict[str, dict[str, str]]:
    """The JSON document of an error: {"error": {"message", "type", "code"}}."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code}}


class ClosingResponse(web.Response):
    """A response after which the connection closes, gracefully.

    The request's body was not read to its end (too large, too slow, unreadable), so
    the connection cannot carry another request. Closing the socket while the client
    is still sending makes the kernel answer with a reset, which can destroy the
    response before the client reads it. Instead the write side is shut down right
    after the response (the client reads the answer, then EOF) while aiohttp's
    lingering close drains whatever the client still sends, until it closes too.
    """

    async def write_eof(self, data: bytes = b"") -> None:
        """Send the end of the response, then half-close the connection (FIN)."""
        request = self._req  # write_eof forgets the request
        await super().write_eof(data)
        transport = request.transport if request is not None else None
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()


def json_error(
    status: int,
    message: str,
    code: str,
    headers: Mapping[str, str] | None = None,
    *,
    closing: bool = False,
) -> web.Response:
    """A JSON error response; `closing`: the connection ends after it (see ClosingResponse)."""
    body = json.dumps(error_body(status, message, code))
    cls = ClosingResponse if closing else web.Response
    response = cls(text=body, status=status, headers=headers, content_type="application/json")
    if closing:
        response.force_close()
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's plain-text HTTP errors (404, 405, ...) into JSON error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = (exc.reason or "error").lower().replace(" ", "_")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return json_error(exc.status, exc.reason or "error", code, headers)
