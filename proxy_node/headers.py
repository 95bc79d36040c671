"""Which headers cross the proxy: the hop-by-hop filter sets, as constants."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from multidict import CIMultiDict

# RFC 9110 §7.6.1 hop-by-hop headers, plus the de-facto Proxy-Connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Client -> engine: aiohttp sets Host and Content-Length for the new hop. The node
# forwards the body aiohttp already decoded, so the client's Content-Encoding would lie.
REQUEST_HEADERS_DROPPED = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",
    "x-request-id",
}
# Engine -> client: the body is re-framed (chunked) and the proxy sets its own X- headers.
RESPONSE_HEADERS_DROPPED = HOP_BY_HOP | {
    "content-length",
    "x-instance-id",
    "x-predicted-ttft-ms",
    "x-prefix-cached-tokens",
    "x-request-id",
}


def _connection_listed(headers: Mapping[str, str]) -> set[str]:
    """Headers that the Connection header names: hop-by-hop for this message only."""
    return {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}


def request_headers(incoming: Mapping[str, str], rid: str) -> CIMultiDict[str]:
    """The client's headers for the engine: hop-by-hop ones dropped, X-Request-Id set."""
    dropped = REQUEST_HEADERS_DROPPED | _connection_listed(incoming)
    headers = CIMultiDict((k, v) for k, v in incoming.items() if k.lower() not in dropped)
    headers["X-Request-Id"] = rid
    return headers


def copy_response_headers(source: Mapping[str, str], response: web.StreamResponse) -> None:
    """Copy the engine's end-to-end headers onto the client's response."""
    dropped = RESPONSE_HEADERS_DROPPED | _connection_listed(source)
    for key, value in source.items():
        if key.lower() not in dropped:
            response.headers.add(key, value)
