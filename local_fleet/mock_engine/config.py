"""The mock engine's settings and its flag/environment table (MOCK_ENGINE_<FLAG>)."""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from coordinator.models import InstanceSpec
from local_fleet.engine_model import EngineTiming

log = logging.getLogger(__name__)

ENV_PREFIX = "MOCK_ENGINE_"
FAULTS = ("error", "hang", "crash")
FAULT_HEADER = "X-Mock-Fault"  # forces one fault on one request (tests)
OUTPUT_TOKENS_HEADER = "X-Mock-Output-Tokens"  # forces the output length (trace replay)

_T = EngineTiming()  # the shared model's documented defaults
REGISTER_TIMING = ("exact", "none")


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    """Mock engine settings; the CLI flags (and MOCK_ENGINE_<FLAG> variables) map onto them."""

    host: str = "127.0.0.1"  # address to bind
    port: int = 8000  # port to bind; 0 picks a free one (start_mock_engine only)
    model: str = "mock-model"  # served model name (/v1/models, responses, metric label)
    max_batch: int = _T.max_batch  # running sequences at most
    prefill_ms_per_token: float = _T.prefill_ms_per_token  # prefill time per prompt token
    prefill_overhead_ms: float = _T.prefill_overhead_ms  # fixed cost of one prefill
    decode_base_ms: float = _T.decode_base_ms  # one decode step at batch size 1
    decode_ms_per_seq: float = _T.decode_ms_per_seq  # extra step time per running sequence
    speed: float = 1.0  # every duration is divided by this
    register_timing: str = "exact"  # exact: register its timing; none: the fleet learns it
    register_speed: float | None = None  # register the timing of this speed (None: own)
    register: str | None = None  # control plane URL(s) to self-register with, comma-separated
    instance_id: str | None = None  # registered id; None = mock-<port>
    token: str | None = None  # bearer token for control-plane writes
    advertise_url: str | None = None  # URL registered; None = http://host:port
    error_rate: float = 0.0  # fraction of requests answered 500 before any byte
    hang_rate: float = 0.0  # fraction of requests never answered
    crash_rate: float = 0.0  # fraction of requests whose stream stops mid-way
    seed: int | None = None  # seed of the fault draws; None = nondeterministic
    default_output_tokens: int = 128  # output length when the request names no cap
    prefix_cache_tokens: int = 0  # prefix KV cache (LRU) in tokens; 0 = no prefix caching
    prefix_block_chars: int = 1024  # characters per cached block (the node's default)
    register_backoff_s: float = 0.5  # first retry delay after a control-plane error
    register_backoff_max_s: float = 10.0  # the retry delay doubles up to this

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {self.speed}")
        self.timing()  # EngineTiming validates the timing constants
        if self.register_timing not in REGISTER_TIMING:
            raise ValueError(f"register_timing must be one of {REGISTER_TIMING}")
        if self.register_speed is not None and not (
            math.isfinite(self.register_speed) and self.register_speed > 0
        ):
            raise ValueError(f"register_speed must be > 0, got {self.register_speed}")
        rates = (self.error_rate, self.hang_rate, self.crash_rate)
        if not all(0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0:
            raise ValueError("error/hang/crash rates must be in [0, 1] and sum to at most 1")
        if self.default_output_tokens < 1:
            raise ValueError("default_output_tokens must be >= 1")
        if self.prefix_cache_tokens < 0 or self.prefix_block_chars < 16:
            raise ValueError("need prefix_cache_tokens >= 0 and prefix_block_chars >= 16")
        for url in self.register_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--register takes http(s) URLs, got {url!r}")
        if self.register_backoff_s <= 0 or self.register_backoff_max_s < self.register_backoff_s:
            raise ValueError("need 0 < register_backoff_s <= register_backoff_max_s")

    def timing(self, speed: float | None = None) -> EngineTiming:
        """The engine timing with every duration divided by `speed` (default: the config's)."""
        return EngineTiming(
            self.prefill_ms_per_token,
            self.prefill_overhead_ms,
            self.decode_base_ms,
            self.decode_ms_per_seq,
            self.max_batch,
        ).scaled(self.speed if speed is None else speed)

    @property
    def url(self) -> str:
        """The URL other processes reach this engine at."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"  # a wildcard bind is reachable on loopback at least
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def register_urls(self) -> list[str]:
        """The control planes `--register` names, in order (none without it): the
        engine uses the first and moves to the next when one stops answering."""
        if self.register is None:
            return []
        return [url.strip() for url in self.register.split(",")]

    def instance_spec(self, epoch: int) -> InstanceSpec:
        """What this engine registers: its timing model (see register_timing) and epoch."""
        spec = InstanceSpec(
            id=self.instance_id or f"mock-{self.port}",
            url=self.url,
            role="mixed",
            max_slots=self.max_batch,
            weight=1.0,
            epoch=epoch,
            model=self.model,
            prefix_cache_tokens=self.prefix_cache_tokens,
        )
        if self.register_timing == "none":
            return spec
        timing = self.timing(self.register_speed)
        return replace(
            spec,
            prefill_ms_per_token=timing.prefill_ms_per_token,
            prefill_overhead_ms=timing.prefill_overhead_ms,
            decode_ms_per_token=timing.nominal_decode_ms_per_token(),
        )


# ---------------------------------------------------------------------------
# Command line.

# (flag, config field, type, help)
_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--host", "host", str, "address to bind"),
    ("--port", "port", int, "port to bind (0 picks a free one)"),
    ("--model", "model", str, "served model name"),
    ("--max-batch", "max_batch", int, "running sequences at most"),
    ("--prefill-ms-per-token", "prefill_ms_per_token", float, "prefill time per prompt token"),
    ("--prefill-overhead-ms", "prefill_overhead_ms", float, "fixed time of one prefill"),
    (
        "--decode-ms-per-token",
        "decode_base_ms",
        float,
        "decode step time at batch size 1 (decode_base_ms)",
    ),
    ("--decode-ms-per-seq", "decode_ms_per_seq", float, "extra decode step time per sequence"),
    ("--speed", "speed", float, "divide every duration by this (replay faster than real time)"),
    (
        "--register-timing",
        "register_timing",
        str,
        "timing to register: exact (its own) or none (the fleet learns it)",
    ),
    (
        "--register-speed",
        "register_speed",
        float,
        "register the timing of this speed instead of its own (a wrong shared spec)",
    ),
    (
        "--register",
        "register",
        str,
        "control-plane URL to self-register with and heartbeat; several, comma-separated: "
        "the next takes over while one does not answer",
    ),
    ("--instance-id", "instance_id", str, "registered instance id; unset means mock-<port>"),
    ("--token", "token", str, "bearer token for control-plane writes"),
    ("--advertise-url", "advertise_url", str, "URL to register; unset means http://host:port"),
    ("--error-rate", "error_rate", float, "fraction of requests answered 500"),
    ("--hang-rate", "hang_rate", float, "fraction of requests never answered"),
    ("--crash-rate", "crash_rate", float, "fraction of requests cut off mid-stream"),
    ("--seed", "seed", int, "seed of the fault draws; unset means random"),
    ("--default-output-tokens", "default_output_tokens", int, "output length without max_tokens"),
    (
        "--prefix-cache-tokens",
        "prefix_cache_tokens",
        int,
        "prefix KV cache in tokens, LRU (0 = off); prefill computes only uncached tokens",
    ),
    (
        "--prefix-block-chars",
        "prefix_block_chars",
        int,
        "characters per prefix cache block (keep it the node's prefix_block_chars)",
    ),
)


_SECRETS = ("token",)  # taken from the environment without showing up in --help
_METAVARS = {"model": "NAME", "register": "URL", "instance_id": "ID", "advertise_url": "URL"}


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the mock engine's flags; each defaults to MOCK_ENGINE_<FLAG> when set."""
    defaults = MockEngineConfig()
    parser.epilog = (
        f"Every flag may also be set by an environment variable {ENV_PREFIX}<FLAG>, "
        f"e.g. {_env_name('--max-batch')}=64; a flag on the command line wins. "
        f"Per request, the header {OUTPUT_TOKENS_HEADER}: N forces the output length and "
        f"{FAULT_HEADER}: error|hang|crash forces a fault."
    )
    for flag, name, kind, help_text in _FLAGS:
        # argparse converts string defaults with `type`, so a bad variable is a clean error.
        env_value = os.environ.get(_env_name(flag))
        if name in _SECRETS:
            env_value = None  # read in config_from_args, so --help never prints it
        default = env_value if env_value is not None else getattr(defaults, name)
        parser.add_argument(
            flag,
            dest=f"mock_{name}",
            type=kind,
            default=default,
            metavar=_METAVARS.get(name, "N" if kind is int else "X" if kind is float else "TEXT"),
            help=f"{help_text} [env {_env_name(flag)}]",
        )


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    """The config named by parsed arguments (raises ValueError on a bad value)."""
    values = {
        f.name: getattr(args, f"mock_{f.name}")
        for f in fields(MockEngineConfig)
        if hasattr(args, f"mock_{f.name}")
    }
    for name in _SECRETS:
        if values.get(name) is None:
            values[name] = os.environ.get(_env_name(f"--{name.replace('_', '-')}"))
    return MockEngineConfig(**values)
