"""NodeConfig: everything one proxy node process needs, validated at start-up."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from coordinator.connection import SCHEMES
from coordinator.errors import InvalidArgumentError
from coordinator.keys import ID_RE, POOL_NAME_RE
from coordinator.settings import STRATEGIES, Settings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# NodeConfig field -> environment variables, first one set wins. The COORD_* knobs of
# coordinator.settings.Settings are read by Settings.from_env() on top of these.
ENV_VARS: dict[str, tuple[str, ...]] = {
    "redis_url": ("COORD_REDIS_URL", "REDIS_URL"),
    "pool": ("COORD_POOL",),
    "host": ("COORD_HOST",),
    "port": ("COORD_PORT",),
    "control_host": ("COORD_CONTROL_HOST",),
    "control_port": ("COORD_CONTROL_PORT",),
    "instances": ("COORD_INSTANCES",),
    "token": ("COORD_TOKEN",),
    "node_id": ("COORD_NODE_ID",),
    "max_body_bytes": ("COORD_MAX_BODY_BYTES",),
    "request_timeout_s": ("COORD_REQUEST_TIMEOUT_S",),
    "body_timeout_s": ("COORD_BODY_TIMEOUT_S",),
    "scrape_interval_s": ("COORD_SCRAPE_INTERVAL_S",),
}

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """One proxy node: where it listens, which pool it serves, and its limits."""

    redis_url: str = DEFAULT_REDIS_URL  # see coordinator.connection: TLS, ACL, cluster, sentinel
    pool: str = "default"  # the pool of instances this node balances over
    host: str = "127.0.0.1"  # service plane bind address
    port: int = 8001  # service plane port (0 = any free port)
    control_host: str | None = None  # control plane bind address (None = same as host)
    control_port: int = 8002  # control plane port (0 = any free port)
    instances: tuple[str, ...] = ()  # static instance URLs registered at start
    token: str | None = None  # bearer token required for control-plane writes (None = open)
    node_id: str | None = None  # stable node id (None = a random one per process)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    request_timeout_s: float = 600.0  # whole upstream exchange, streaming included
    body_timeout_s: float = 60.0  # reading one request body; a slower client gets 408
    scrape_interval_s: float = 2.0  # engine /metrics scrape period (0 = off)
    settings: Settings = field(default_factory=Settings)  # coordinator knobs (COORD_*)

    def __post_init__(self) -> None:
        if not isinstance(self.redis_url, str) or not self.redis_url.startswith(SCHEMES):
            raise InvalidArgumentError(
                f"redis URL must start with one of {SCHEMES}, got {self.redis_url!r}"
            )
        if not isinstance(self.pool, str) or not POOL_NAME_RE.fullmatch(self.pool):
            raise InvalidArgumentError(
                f"pool {self.pool!r} must match {POOL_NAME_RE.pattern} (no braces)"
            )
        for name in ("host", "control_host"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidArgumentError(f"{name} must be a non-empty address")
        for name in ("port", "control_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise InvalidArgumentError(f"{name} must be an integer in 0..65535, got {value!r}")
        if self.port and self.port == self.control_port and self.bind_control == self.host:
            raise InvalidArgumentError("port and control_port must differ")
        for url in self.instances:
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidArgumentError(
                    f"instance URL must be http(s)://host[:port], got {url!r}"
                )
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise InvalidArgumentError("token must be a non-empty string when set")
        if self.node_id is not None and (
            not isinstance(self.node_id, str) or not ID_RE.fullmatch(self.node_id)
        ):
            raise InvalidArgumentError(f"node id {self.node_id!r} must match {ID_RE.pattern}")
        if (
            isinstance(self.max_body_bytes, bool)
            or not isinstance(self.max_body_bytes, int)
            or self.max_body_bytes <= 0
        ):
            raise InvalidArgumentError(
                f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}"
            )
        if not _finite(self.request_timeout_s) or self.request_timeout_s <= 0:
            raise InvalidArgumentError(
                f"request_timeout_s must be a number > 0, got {self.request_timeout_s!r}"
            )
        if not _finite(self.body_timeout_s) or self.body_timeout_s <= 0:
            raise InvalidArgumentError(
                f"body_timeout_s must be a number > 0, got {self.body_timeout_s!r}"
            )
        if not _finite(self.scrape_interval_s) or self.scrape_interval_s < 0:
            raise InvalidArgumentError(
                f"scrape_interval_s must be a number >= 0 (0 = off), got {self.scrape_interval_s!r}"
            )
        if not isinstance(self.settings, Settings):
            raise InvalidArgumentError("settings must be a coordinator Settings")

    @property
    def bind_control(self) -> str:
        """The control plane's bind address."""
        return self.control_host or self.host

    @property
    def strategy(self) -> str:
        """The selection strategy (lives in the coordinator settings)."""
        return self.settings.strategy

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Read the environment (see ENV_VARS and Settings), then apply non-None overrides.

        `strategy=` is accepted as an override and lands in the coordinator settings.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            for var in ENV_VARS.get(f.name, ()):
                raw = env.get(var)
                if raw is not None and raw != "":
                    values[f.name] = _parse(f.name, var, raw)
                    break
        given = {k: v for k, v in overrides.items() if v is not None}
        strategy = given.pop("strategy", None)
        settings = given.pop("settings", None)
        if settings is None:
            settings = Settings.from_env(env)
        if strategy is not None:
            if strategy not in STRATEGIES:
                raise InvalidArgumentError(
                    f"strategy must be one of {STRATEGIES}, got {strategy!r}"
                )
            settings = replace(settings, strategy=strategy)
        if "instances" in given:
            given["instances"] = tuple(given["instances"])
        values.update(given)
        return cls(settings=settings, **values)

    def with_(self, **changes: Any) -> NodeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _parse(name: str, var: str, raw: str) -> Any:
    if name == "instances":
        return tuple(u.strip() for u in raw.split(",") if u.strip())
    if name in ("port", "control_port", "max_body_bytes"):
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgumentError(f"{var} must be an integer, got {raw!r}") from None
    if name in ("request_timeout_s", "body_timeout_s", "scrape_interval_s"):
        try:
            return float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{var} must be a number, got {raw!r}") from None
    return raw


def instance_id_for(url: str) -> str:
    """A static instance's id: its host:port, reduced to the id charset."""
    parts = urlsplit(url)
    host = parts.hostname or "instance"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    raw = _ID_UNSAFE.sub("-", f"{host}:{port}")
    if not raw[:1].isalnum():
        raw = "i" + raw
    return raw[:128]
