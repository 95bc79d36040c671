"""`coordinator serve`: run one proxy node (service plane + control plane)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from contextlib import suppress
from dataclasses import fields
from typing import Any

from aiohttp import web

from coordinator.connection import redact
from coordinator.errors import InvalidArgumentError
from coordinator.settings import STRATEGIES, Settings
from proxy_node.app import create_app, create_control_app
from proxy_node.config import NodeConfig
from proxy_node.edge import AcceptErrorLog, EdgeRunner, auto_max_connections
from proxy_node.state import METRICS, STATE

log = logging.getLogger(__name__)

# aiohttp's HTTP parser limits, spelled out so an aiohttp upgrade cannot move them:
# a longer request line or header, or more headers, gets a plain-text 400 from the
# parser before any handler runs (docs/security.md).
HTTP_LIMITS: dict[str, Any] = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `coordinator serve`; each can also come from the environment."""
    d = NodeConfig()
    # Defaults are SUPPRESSed so that an unset flag falls back to the environment,
    # then to NodeConfig's default; the help text names both.
    add = parser.add_argument
    S = argparse.SUPPRESS
    add(
        "--redis-url",
        default=S,
        help="Redis URL: redis://, rediss:// (TLS), unix://, redis+cluster://h:p,h:p, "
        "redis+sentinel://h:p,h:p/master; may carry user:password "
        f"[env COORD_REDIS_URL or REDIS_URL; default {d.redis_url}]",
    )
    add(
        "--pool",
        default=S,
        help=f"pool of instances to balance over [env COORD_POOL; default {d.pool}]",
    )
    add("--host", default=S, help=f"service plane bind address [env COORD_HOST; default {d.host}]")
    add(
        "--port",
        type=int,
        default=S,
        help=f"service plane port (OpenAI API) [env COORD_PORT; default {d.port}]",
    )
    add(
        "--control-host",
        default=S,
        help="control plane bind address [env COORD_CONTROL_HOST; default: same as --host]",
    )
    add(
        "--control-port",
        type=int,
        default=S,
        help="control plane port (registration, heartbeats, /debug) "
        f"[env COORD_CONTROL_PORT; default {d.control_port}]",
    )
    add(
        "--instance",
        dest="instances",
        action="append",
        metavar="URL",
        default=S,
        help="static engine URL, registered at start with an id from host:port and kept "
        "alive by this node; repeat for several [env COORD_INSTANCES, comma-separated]",
    )
    add(
        "--strategy",
        choices=STRATEGIES,
        default=S,
        help=f"selection strategy [env COORD_STRATEGY; default {d.settings.strategy}]",
    )
    add(
        "--prefix-affinity",
        action=argparse.BooleanOptionalAction,
        default=S,
        help="route by prefix cache: look up and record salted prompt block hashes in the "
        "shared index, and rank on each instance's uncached prefill [env "
        "COORD_PREFIX_AFFINITY; default on]",
    )
    add(
        "--token",
        default=S,
        help="bearer token required for control-plane writes; prefer the environment, "
        "command lines are visible to other users [env COORD_TOKEN; default: none, open]",
    )
    add(
        "--node-id",
        default=S,
        help="this node's id in the pool, one per process: a restart may reuse it (the "
        "new process releases what the old one held), two live processes must not "
        "[env COORD_NODE_ID; default: random per process]",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=S,
        help=f"larger request bodies get 413 [env COORD_MAX_BODY_BYTES; default {d.max_body_bytes}]",
    )
    add(
        "--request-timeout-s",
        type=float,
        default=S,
        help="limit of one whole upstream exchange, streaming included "
        f"[env COORD_REQUEST_TIMEOUT_S; default {d.request_timeout_s:g}]",
    )
    add(
        "--body-timeout-s",
        type=float,
        default=S,
        help="limit of reading one request body; a slower client gets 408 "
        f"[env COORD_BODY_TIMEOUT_S; default {d.body_timeout_s:g}]",
    )
    add(
        "--scrape-interval-s",
        type=float,
        default=S,
        help="period of engine /metrics scraping for hints, 0 = off "
        f"[env COORD_SCRAPE_INTERVAL_S; default {d.scrape_interval_s:g}]",
    )
    add(
        "--instance-model",
        default=S,
        help="model name of the --instance engines [env COORD_INSTANCE_MODEL; "
        "default: the first model the engine's GET /v1/models lists]",
    )
    add(
        "--connect-timeout-s",
        type=float,
        default=S,
        help="TCP connect to an engine; on expiry another instance is tried "
        f"[env COORD_CONNECT_TIMEOUT_S; default {d.connect_timeout_s:g}]",
    )
    add(
        "--first-byte-timeout-s",
        type=float,
        default=S,
        help="request sent to the first response byte (a non-streaming answer's whole "
        "generation); on expiry another instance is tried, else 504 "
        f"[env COORD_FIRST_BYTE_TIMEOUT_S; default {d.first_byte_timeout_s:g}]",
    )
    add(
        "--idle-timeout-s",
        type=float,
        default=S,
        help="longest silence between two chunks of a response; on expiry the response "
        f"is cut [env COORD_IDLE_TIMEOUT_S; default {d.idle_timeout_s:g}]",
    )
    add(
        "--send-timeout-s",
        type=float,
        default=S,
        help="longest a write of the response to the client may wait (a client that "
        "stopped reading holds the engine's stream and its reservation); on expiry the "
        f"client's connection is cut [env COORD_SEND_TIMEOUT_S; default {d.send_timeout_s:g}]",
    )
    add(
        "--header-timeout-s",
        type=float,
        default=S,
        help="a request head, and an idle keep-alive connection, must not take longer "
        f"(slowloris) [env COORD_HEADER_TIMEOUT_S; default {d.header_timeout_s:g}]",
    )
    add(
        "--max-connections",
        type=int,
        default=S,
        help="open client connections per plane; more are refused with 503 "
        "[env COORD_MAX_CONNECTIONS; default 0 = a quarter of the open-file limit]",
    )
    add(
        "--drain-timeout-s",
        type=float,
        default=S,
        help="on SIGTERM/SIGINT, in-flight requests get this long to finish "
        f"[env COORD_DRAIN_TIMEOUT_S; default {d.drain_timeout_s:g}]",
    )
    add(
        "--drain-delay-s",
        type=float,
        default=S,
        help="on SIGTERM/SIGINT, first keep serving this long while /healthz answers 503 "
        "draining, so that health-checking load balancers stop sending new requests "
        f"[env COORD_DRAIN_DELAY_S; default {d.drain_delay_s:g}]",
    )
    add(
        "--eject-consecutive-failures",
        type=int,
        default=S,
        help="failures in a row (5xx, refused, timeout, cut or empty answer) that eject an "
        "instance fleet-wide, 0 = off "
        f"[env COORD_EJECT_CONSECUTIVE_FAILURES; default {d.eject_consecutive_failures}]",
    )
    add(
        "--eject-failure-window-s",
        type=float,
        default=S,
        help="failures further apart than this do not add up "
        f"[env COORD_EJECT_FAILURE_WINDOW_S; default {d.eject_failure_window_s:g}]",
    )
    add(
        "--eject-base-s",
        type=float,
        default=S,
        help="first ejection of an instance; doubles with each repeat "
        f"[env COORD_EJECT_BASE_S; default {d.eject_base_s:g}]",
    )
    add(
        "--eject-max-s",
        type=float,
        default=S,
        help=f"longest ejection [env COORD_EJECT_MAX_S; default {d.eject_max_s:g}]",
    )
    add(
        "--eject-max-percent",
        type=float,
        default=S,
        help="never eject more than this share of the alive instances "
        f"[env COORD_EJECT_MAX_PERCENT; default {d.eject_max_percent:g}]",
    )
    add(
        "--eject-failure-percent",
        type=float,
        default=S,
        help="eject an instance once this share (percent) of this node's last "
        "--eject-failure-volume exchanges with it, within a minute, failed, in a row or "
        "not (Envoy failure_percentage), 0 = off "
        f"[env COORD_EJECT_FAILURE_PERCENT; default {d.eject_failure_percent:g}]",
    )
    add(
        "--eject-failure-volume",
        type=int,
        default=S,
        help="exchanges the failure share is judged over "
        f"[env COORD_EJECT_FAILURE_VOLUME; default {d.eject_failure_volume}]",
    )
    add(
        "--insecure-open-control-plane",
        action="store_true",
        default=S,
        help="serve the control plane on a non-loopback address without a token: anyone "
        "reaching it can register engines and receive prompts "
        "[env COORD_INSECURE_OPEN_CONTROL_PLANE; default: refused]",
    )
    knobs = ", ".join(
        f"COORD_{f.name.upper()} ({getattr(Settings(), f.name) if f.name != 'weights' else 'name=value,...'})"
        for f in fields(Settings)
        if f.name != "strategy"
    )
    parser.epilog = (
        "Coordinator knobs, from the environment only (default in parentheses): " + knobs + "."
    )


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    """NodeConfig from flags over the environment; raises InvalidArgumentError."""
    names = (
        "redis_url",
        "pool",
        "host",
        "port",
        "control_host",
        "control_port",
        "instances",
        "strategy",
        "prefix_affinity",
        "token",
        "node_id",
        "max_body_bytes",
        "request_timeout_s",
        "body_timeout_s",
        "scrape_interval_s",
        "instance_model",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "idle_timeout_s",
        "send_timeout_s",
        "header_timeout_s",
        "max_connections",
        "drain_timeout_s",
        "drain_delay_s",
        "eject_consecutive_failures",
        "eject_failure_window_s",
        "eject_base_s",
        "eject_max_s",
        "eject_max_percent",
        "eject_failure_percent",
        "eject_failure_volume",
        "insecure_open_control_plane",
    )
    return NodeConfig.from_env(os.environ, **{n: getattr(args, n, None) for n in names})


def run(args: argparse.Namespace) -> int:
    """Entry point of `coordinator serve`."""
    try:
        config = config_from_args(args)
    except InvalidArgumentError as exc:
        print(f"coordinator serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # typically a port already in use
        print(f"coordinator serve: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: NodeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve both planes until SIGINT/SIGTERM (or until `stop` is set).

    Raises OSError when a port cannot be bound, after stopping everything it started.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    service = create_app(config)
    cap = config.max_connections or auto_max_connections()

    def refused() -> None:
        if METRICS in service:
            service[METRICS].refused_connections.inc()

    def malformed() -> None:
        if METRICS in service:
            service[METRICS].malformed_requests.inc()

    runner_args: dict[str, Any] = {
        **HTTP_LIMITS,
        "max_connections": cap,
        "on_refused": refused,
        "on_malformed": malformed,
        "shutdown_timeout": config.drain_timeout_s,
        # aiohttp's keep-alive timer runs from the accept and between requests, and
        # closes the connection while no complete head has arrived: a head timeout.
        "keepalive_timeout": config.header_timeout_s,
    }
    service_runner = EdgeRunner(service, **runner_args)
    await service_runner.setup()  # runs the cleanup contexts: the Coordinator exists after this
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(AcceptErrorLog(service[METRICS].accept_errors.inc))
    control_runner = EdgeRunner(create_control_app(service), **runner_args)
    await control_runner.setup()
    try:
        await web.TCPSite(service_runner, config.host, config.port).start()
        await web.TCPSite(control_runner, config.bind_control, config.control_port).start()
        log.info(
            "service plane on %s, control plane on %s, redis %s, pool %s, strategy %s%s",
            _addresses(service_runner),
            _addresses(control_runner),
            redact(config.redis_url),
            config.pool,
            config.strategy,
            "" if config.token else " (control plane open: no token)",
        )
        if config.token is None and config.insecure_open_control_plane:
            log.warning(
                "INSECURE: the control plane on %s takes registrations without a token "
                "(--insecure-open-control-plane)",
                config.bind_control,
            )
        await stop.wait()
        await _drain_delay(service, config)
        log.info("shutting down (drain timeout %g s)", config.drain_timeout_s)
    finally:
        await control_runner.cleanup()
        await service_runner.cleanup()
        loop.set_exception_handler(previous_handler)


async def _drain_delay(service: web.Application, config: NodeConfig) -> None:
    """Turn not-ready (/healthz 503 draining), then keep serving for the drain delay.

    A balancer that health-checks the node stops sending new requests meanwhile;
    requests that still arrive are served. Then the listeners close (the caller).
    """
    service[STATE].draining = True
    log.info(
        "draining: /healthz answers 503; serving %g s more, then in-flight requests "
        "get %g s to finish",
        config.drain_delay_s,
        config.drain_timeout_s,
    )
    if config.drain_delay_s > 0:
        await asyncio.sleep(config.drain_delay_s)


def _addresses(runner: web.AppRunner) -> str:
    return ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses)
