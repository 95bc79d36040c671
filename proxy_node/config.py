"""NodeConfig: everything one proxy node process needs, validated at start-up."""

from __future__ import annotations

import ipaddress
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
from coordinator.outliers import OutlierPolicy
from coordinator.settings import STRATEGIES, Settings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_OUTLIERS = OutlierPolicy()  # the passive-health defaults

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
    "instance_model": ("COORD_INSTANCE_MODEL",),
    "connect_timeout_s": ("COORD_CONNECT_TIMEOUT_S",),
    "first_byte_timeout_s": ("COORD_FIRST_BYTE_TIMEOUT_S",),
    "idle_timeout_s": ("COORD_IDLE_TIMEOUT_S",),
    "send_timeout_s": ("COORD_SEND_TIMEOUT_S",),
    "header_timeout_s": ("COORD_HEADER_TIMEOUT_S",),
    "max_connections": ("COORD_MAX_CONNECTIONS",),
    "drain_timeout_s": ("COORD_DRAIN_TIMEOUT_S",),
    "drain_delay_s": ("COORD_DRAIN_DELAY_S",),
    "eject_consecutive_failures": ("COORD_EJECT_CONSECUTIVE_FAILURES",),
    "eject_failure_window_s": ("COORD_EJECT_FAILURE_WINDOW_S",),
    "eject_base_s": ("COORD_EJECT_BASE_S",),
    "eject_max_s": ("COORD_EJECT_MAX_S",),
    "eject_max_percent": ("COORD_EJECT_MAX_PERCENT",),
    "eject_failure_percent": ("COORD_EJECT_FAILURE_PERCENT",),
    "eject_failure_volume": ("COORD_EJECT_FAILURE_VOLUME",),
    "insecure_open_control_plane": ("COORD_INSECURE_OPEN_CONTROL_PLANE",),
}

INT_FIELDS = frozenset({"port", "control_port", "max_body_bytes", "max_connections"})
INT_FIELDS |= {"eject_consecutive_failures", "eject_failure_volume"}
FLOAT_FIELDS = frozenset(
    {
        "request_timeout_s",
        "body_timeout_s",
        "scrape_interval_s",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "idle_timeout_s",
        "send_timeout_s",
        "header_timeout_s",
        "drain_timeout_s",
        "drain_delay_s",
        "eject_failure_window_s",
        "eject_base_s",
        "eject_max_s",
        "eject_max_percent",
        "eject_failure_percent",
    }
)
BOOL_FIELDS = frozenset({"insecure_open_control_plane"})
# Timeouts that must be > 0 (their meaning is in NodeConfig's field comments).
POSITIVE_SECONDS = (
    "request_timeout_s",
    "body_timeout_s",
    "connect_timeout_s",
    "first_byte_timeout_s",
    "idle_timeout_s",
    "send_timeout_s",
    "header_timeout_s",
    "drain_timeout_s",
    "eject_failure_window_s",
    "eject_base_s",
    "eject_max_s",
)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

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
    instance_model: str | None = None  # model name of static instances (None = ask the engine)
    connect_timeout_s: float = 5.0  # TCP connect to an engine; then another instance is tried
    first_byte_timeout_s: float = 120.0  # request sent -> first response byte (whole answer
    # of a non-streaming request); then another instance is tried, or 504
    idle_timeout_s: float = 60.0  # longest silence between two chunks of a response
    send_timeout_s: float = 60.0  # longest one write to the client may wait (a client that
    # stopped reading; nginx send_timeout); then its connection is cut
    header_timeout_s: float = 60.0  # a client's request head (and an idle keep-alive) must
    # arrive within this; slowloris connections are closed
    max_connections: int = 0  # open client connections per plane (0 = half the open-file limit)
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    drain_delay_s: float = 0.0  # on SIGTERM, keep serving (but not ready) this long first
    # Passive health (coordinator/outliers.py OutlierPolicy, whose defaults these are):
    # failures in a row that eject an instance (0 = off), within a window (nginx
    # fail_timeout); the first ejection, doubling with each repeat up to the longest
    # (Envoy max_ejection_time); never more than this share of the alive instances
    # ejected; and this share of failures among a node's last `eject_failure_volume`
    # exchanges with an instance (within a minute) ejects it (0 = off).
    eject_consecutive_failures: int = _OUTLIERS.consecutive_failures
    eject_failure_window_s: float = _OUTLIERS.failure_window_ms / 1000
    eject_base_s: float = _OUTLIERS.base_ejection_ms / 1000
    eject_max_s: float = _OUTLIERS.max_ejection_ms / 1000
    eject_max_percent: float = _OUTLIERS.max_ejection_percent
    eject_failure_percent: float = _OUTLIERS.failure_percent
    eject_failure_volume: int = _OUTLIERS.failure_volume
    insecure_open_control_plane: bool = False  # allow a tokenless control plane off loopback
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
        object.__setattr__(
            self, "instances", tuple(normalize_instance_url(url) for url in self.instances)
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
        for name in POSITIVE_SECONDS:
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a number > 0, got {value!r}")
        for name in ("max_connections", "eject_consecutive_failures", "eject_failure_volume"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("eject_max_percent", "eject_failure_percent"):
            value = getattr(self, name)
            if not _finite(value) or not 0 <= value <= 100:
                raise InvalidArgumentError(f"{name} must be a number in 0..100, got {value!r}")
        if self.eject_failure_percent > 0 and self.eject_failure_volume < 1:
            raise InvalidArgumentError("eject_failure_volume must be >= 1 (or the percent 0)")
        if _finite(self.eject_max_s) and _finite(self.eject_base_s):
            if self.eject_max_s < self.eject_base_s:
                raise InvalidArgumentError("eject_max_s must be >= eject_base_s")
        if self.instance_model is not None and (
            not isinstance(self.instance_model, str) or not self.instance_model.strip()
        ):
            raise InvalidArgumentError("instance_model must be a non-empty string when set")
        if not isinstance(self.insecure_open_control_plane, bool):
            raise InvalidArgumentError("insecure_open_control_plane must be a boolean")
        if (
            self.token is None
            and not self.insecure_open_control_plane
            and not is_loopback(self.bind_control)
        ):
            raise InvalidArgumentError(
                f"refusing to serve the control plane on {self.bind_control!r} without a "
                "token: anyone who reaches it could register engines and receive prompts. "
                "Set --token (COORD_TOKEN), bind --control-host 127.0.0.1, or pass "
                "--insecure-open-control-plane to accept the risk"
            )
        if not _finite(self.drain_delay_s) or self.drain_delay_s < 0:
            raise InvalidArgumentError(
                f"drain_delay_s must be a number >= 0 (0 = none), got {self.drain_delay_s!r}"
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
    def outlier_policy(self) -> OutlierPolicy:
        """The passive-health policy these settings describe."""
        return OutlierPolicy(
            consecutive_failures=self.eject_consecutive_failures,
            failure_window_ms=max(1, round(self.eject_failure_window_s * 1000)),
            base_ejection_ms=max(1, round(self.eject_base_s * 1000)),
            max_ejection_ms=max(1, round(self.eject_max_s * 1000)),
            max_ejection_percent=float(self.eject_max_percent),
            failure_percent=float(self.eject_failure_percent),
            failure_volume=self.eject_failure_volume,
        )

    @property
    def strategy(self) -> str:
        """The selection strategy (lives in the coordinator settings)."""
        return self.settings.strategy

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Read the environment (see ENV_VARS and Settings), then apply non-None overrides.

        `strategy=` and `prefix_affinity=` are accepted as overrides and land in the
        coordinator settings.
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
        affinity = given.pop("prefix_affinity", None)
        settings = given.pop("settings", None)
        if settings is None:
            settings = Settings.from_env(env)
        if affinity is not None:
            settings = replace(settings, prefix_affinity=bool(affinity))
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
    if name in INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgumentError(f"{var} must be an integer, got {raw!r}") from None
    if name in FLOAT_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{var} must be a number, got {raw!r}") from None
    if name in BOOL_FIELDS:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"{var} must be a boolean (1/0, true/false), got {raw!r}")
    return raw


def normalize_instance_url(url: Any) -> str:
    """An engine's base URL: `http(s)://host[:port][/prefix]`, a trailing `/v1` removed.

    The node appends the client's path (`/v1/chat/completions`) to it, so a base URL
    that already ends in `/v1` would send every request to `/v1/v1/...` (404).
    """
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgumentError(f"instance URL must be http(s)://host[:port], got {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidArgumentError(
            f"instance URL must not carry a query, fragment or credentials, got {url!r}"
        )
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError as exc:
        raise InvalidArgumentError(f"instance URL {url!r}: {exc}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")].rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts local connections (names other than localhost: no)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def instance_id_for(url: str) -> str:
    """A static instance's id: its host:port, reduced to the id charset."""
    parts = urlsplit(url)
    host = parts.hostname or "instance"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    raw = _ID_UNSAFE.sub("-", f"{host}:{port}")
    if not raw[:1].isalnum():
        raw = "i" + raw
    return raw[:128]
