"""An engine's self-registration with a proxy node's control plane, kept alive by heartbeats.

The control plane answers `POST /v1/instances` with `{instance_id, epoch,
heartbeat_interval_s, ttl_s}`, heartbeats with 200 (or 404 for an instance it no
longer knows, which asks for a re-registration) and `DELETE /v1/instances/{id}`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
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
        control_url: str,
        spec: InstanceSpec,
        hints: Callable[[], dict[str, float]],
        *,
        token: str | None = None,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
    ) -> None:
        if not control_url.startswith(("http://", "https://")):
            raise ValueError(f"control plane URL must be http(s), got {control_url!r}")
        if backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ValueError("backoff must satisfy 0 < backoff_s <= backoff_max_s")
        self.control_url = control_url.rstrip("/")
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
        """Remove the instance from the control plane; failures are logged, not raised."""
        if not self.registered:
            return
        url = f"{self.control_url}/v1/instances/{self.spec.id}"
        try:
            async with self.session.delete(url, headers=self._headers()) as resp:
                if resp.status >= 300 and resp.status != 404:
                    log.warning("unregistering %s: %s", self.spec.id, resp.status)
                else:
                    log.info("unregistered %s from %s", self.spec.id, self.control_url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("unregistering %s failed: %r", self.spec.id, exc)
        self.registered = False

    async def run(self) -> None:
        """Register, then heartbeat until cancelled; errors are retried with backoff.

        A refused credential (RegistrationDeniedError) is raised, not retried: the same
        token will be refused again.
        """
        delay = self.backoff_s
        while True:
            try:
                if not self.registered:
                    await self.register()
                    delay = self.backoff_s
                await asyncio.sleep(self.heartbeat_interval_s)
                if not await self.heartbeat():
                    # The control plane lost us (restart, TTL expiry): register again now.
                    log.info("%s unknown to the control plane; re-registering", self.spec.id)
                    self.registered = False
                    continue
                delay = self.backoff_s
            except RegistrationDeniedError:
                raise
            except (aiohttp.ClientError, TimeoutError, RegistrationError, ValueError) as exc:
                log.warning(
                    "control plane %s: %r; retrying in %.2f s", self.control_url, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
