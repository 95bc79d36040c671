"""An engine's self-registration with a proxy node's control plane, kept alive by heartbeats.

The control plane answers `POST /v1/instances` with `{instance_id, epoch,
heartbeat_interval_s, ttl_s}`, heartbeats with 200 (or 404 for an instance it no
longer knows, which asks for a re-registration) and `DELETE /v1/instances/{id}`.
Every node's control plane serves the whole pool (the registry is in Redis), so an
engine given several control planes moves to the next when one stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from types import TracebackType
from typing import Any

import aiohttp

from coordinator.models import InstanceSpec

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 3.0  # used when a registration answer does not name one
MIN_HEARTBEAT_INTERVAL_S = 0.01  # a zero or negative interval would spin the loop
REQUEST_TIMEOUT_S = 5.0  # one control-plane call; a dead plane must not stall the loop


class RegistrationError(Exception):
    """The control plane refused a call (a status other than the expected ones)."""


class RegistrationDeniedError(RegistrationError):
    """The control plane refused our credentials (401/403): retrying cannot help."""


DENIED = (401, 403)


def _refusal(what: str, status: int, text: str) -> RegistrationError:
    kind = RegistrationDeniedError if status in DENIED else RegistrationError
    hint = " (check the bearer token)" if status in DENIED else ""
    return kind(f"{what} refused: {status} {text[:200]}{hint}")


class Registrar:
    """Keeps one instance registered: register, heartbeat, re-register on 404, unregister."""

    def __init__(
        self,
        control_urls: str | Sequence[str],
        spec: InstanceSpec,
        hints: Callable[[], dict[str, float]],
        *,
        token: str | None = None,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
    ) -> None:
        urls = [control_urls] if isinstance(control_urls, str) else list(control_urls)
        if not urls:
            raise ValueError("need at least one control plane URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"control plane URL must be http(s), got {url!r}")
        if backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ValueError("backoff must satisfy 0 < backoff_s <= backoff_max_s")
        self.control_urls = [url.rstrip("/") for url in urls]
        self._current = 0  # the control plane in use: the last one that answered
        self.spec = spec
        self.hints = hints
        self.token = token
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self.registered = False
        self.registrations = 0  # successful registrations, re-registrations included
        self.heartbeats = 0  # accepted heartbeats
        self._session: aiohttp.ClientSession | None = None

    @property
    def control_url(self) -> str:
        """The control plane in use: the first given, until one fails to answer."""
        return self.control_urls[self._current]

    def _next_control_plane(self) -> None:
        self._current = (self._current + 1) % len(self.control_urls)

    async def __aenter__(self) -> Registrar:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session (only inside `async with registrar`)."""
        if self._session is None:
            raise RuntimeError("use the Registrar inside `async with`")
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def spec_body(self) -> dict[str, Any]:
        """The InstanceSpec as the JSON body of `POST /v1/instances`."""
        body = asdict(self.spec)
        body["tags"] = list(self.spec.tags)
        return body

    async def register(self) -> dict[str, Any]:
        """Register (upsert) the instance; returns the control plane's answer."""
        url = f"{self.control_url}/v1/instances"
        async with self.session.post(url, json=self.spec_body(), headers=self._headers()) as resp:
            if resp.status >= 300:
                raise _refusal("registration", resp.status, await resp.text())
            answer = await resp.json(content_type=None)
        if not isinstance(answer, dict):
            raise RegistrationError(f"registration answer is not an object: {answer!r}")
        interval = answer.get("heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S)
        if isinstance(interval, bool) or not isinstance(interval, int | float):
            interval = DEFAULT_HEARTBEAT_INTERVAL_S
        if not math.isfinite(interval):
            interval = DEFAULT_HEARTBEAT_INTERVAL_S
        self.heartbeat_interval_s = max(MIN_HEARTBEAT_INTERVAL_S, float(interval))
        self.registered = True
        self.registrations += 1
        log.info(
            "registered %s (%s) at %s: epoch %s, heartbeat every %.2f s",
            self.spec.id,
            self.spec.url,
            self.control_url,
            answer.get("epoch"),
            self.heartbeat_interval_s,
        )
        return answer

    async def heartbeat(self) -> bool:
        """Send one heartbeat with hints; False when the instance is unknown (404)."""
        url = f"{self.control_url}/v1/instances/{self.spec.id}/heartbeat"
        body = {"hints": self.hints()}
        async with self.session.post(url, json=body, headers=self._headers()) as resp:
            if resp.status == 404:
                return False
            if resp.status >= 300:
                raise _refusal("heartbeat", resp.status, await resp.text())
        self.heartbeats += 1
        return True

    async def unregister(self) -> None:
        """Remove the instance from the control plane, trying each one until one
        answers; failures are logged, not raised."""
        if not self.registered:
            return
        for _ in self.control_urls:
            url = f"{self.control_url}/v1/instances/{self.spec.id}"
            try:
                async with self.session.delete(url, headers=self._headers()) as resp:
                    if resp.status >= 300 and resp.status != 404:
                        log.warning("unregistering %s: %s", self.spec.id, resp.status)
                    else:
                        log.info("unregistered %s from %s", self.spec.id, self.control_url)
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning(
                    "unregistering %s at %s failed: %r", self.spec.id, self.control_url, exc
                )
                self._next_control_plane()
        self.registered = False

    async def run(self) -> None:
        """Register, then heartbeat until cancelled; errors are retried with backoff.

        A control plane that fails to answer (refused, timed out, an error status)
        gives way at once to the next one given, with the heartbeat that failed: any
        node's control plane serves the whole pool, so an engine stays registered
        while one node is down. Backoff starts once every one has failed in a row.
        A refused credential (RegistrationDeniedError) from every control plane in a
        row is raised, not retried: the same token will be refused again (one node
        that refuses it, misconfigured, gives way to the next like a dead one).
        """
        delay = self.backoff_s
        others = len(self.control_urls) - 1  # to try at once before backing off
        due = False  # a heartbeat is owed now: the last attempt failed
        while True:
            try:
                if not self.registered:
                    await self.register()
                    due = False
                if not due:
                    await asyncio.sleep(self.heartbeat_interval_s)
                due = True
                if not await self.heartbeat():
                    # The control plane lost us (restart, TTL expiry): register again now.
                    log.info("%s unknown to the control plane; re-registering", self.spec.id)
                    self.registered = False
                    continue
                due = False
                delay, others = self.backoff_s, len(self.control_urls) - 1
            except (aiohttp.ClientError, TimeoutError, RegistrationError, ValueError) as exc:
                failed = self.control_url
                self._next_control_plane()
                if others > 0:
                    others -= 1
                    log.warning("control plane %s: %r; trying %s", failed, exc, self.control_url)
                    continue
                if isinstance(exc, RegistrationDeniedError):
                    raise  # every control plane refused: the same token will be refused
                log.warning("control plane %s: %r; retrying in %.2f s", failed, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                others = len(self.control_urls) - 1
