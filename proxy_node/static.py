"""Static instances (`--instance URL`): probed, registered and kept alive by the node.

A static instance has no agent of its own to heartbeat it, so the node that lists it
does, as an nginx upstream block asserts a server exists. Liveness still means the
engine answers (docs/reliability.md): every heartbeat interval the node asks the
engine for `GET /v1/models`, and heartbeats only an engine that answered. An engine
that stops answering stops being alive after `instance_ttl_ms`, on every node.

The same answer names the model when `--instance-model` does not. The node also
restores what it asserts: a registration that moved the id to another URL, or a
registry that lost it, is undone at the next round.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from coordinator import Coordinator, InstanceSpec
from coordinator.errors import CoordinatorError, UnknownInstanceError
from coordinator.models import InstanceLoad
from coordinator.tasks import raise_if_cancelling
from proxy_node.bodies import read_up_to
from proxy_node.config import instance_id_for

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # one GET /v1/models; a slower engine counts as not answering
MAX_MODELS_BYTES = 1024 * 1024  # a larger /v1/models answer is not an engine's


@dataclass
class StaticInstance:
    """One `--instance` URL and what the node last learned about it."""

    spec: InstanceSpec  # id from host:port; model from the flag or from the engine
    model_from_flag: bool = False
    answering: bool | None = None  # the last probe's outcome (None before the first)


def static_instances(urls: Sequence[str], model: str | None = None) -> list[StaticInstance]:
    """One StaticInstance per URL (URLs are already normalized by NodeConfig)."""
    return [
        StaticInstance(
            InstanceSpec(id=instance_id_for(url), url=url.rstrip("/"), model=model),
            model_from_flag=model is not None,
        )
        for url in urls
    ]


async def engine_models(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> list[dict[str, Any]]:
    """GET {url}/v1/models: its entries with a string id (raises when it fails, or when
    the answer is over MAX_MODELS_BYTES, is no JSON or has no data list)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Accept-Encoding": "identity"}
    async with session.get(
        url.rstrip("/") + "/v1/models", timeout=timeout, headers=headers
    ) as resp:
        if resp.status != 200:
            raise ValueError(f"GET /v1/models answered {resp.status}")
        raw = await read_up_to(resp.content, MAX_MODELS_BYTES + 1)
    if len(raw) > MAX_MODELS_BYTES:
        raise ValueError(f"GET /v1/models is larger than {MAX_MODELS_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"GET /v1/models is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("GET /v1/models has no data list")
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """GET {url}/v1/models: the first model id (None for an empty list); raises when it fails."""
    for entry in await engine_models(session, url, timeout_s):
        if entry["id"]:
            return str(entry["id"])
    return None


async def maintain(
    coordinator: Coordinator,
    session: aiohttp.ClientSession,
    instances: Sequence[StaticInstance],
    timeout_s: float = PROBE_TIMEOUT_S,
) -> None:
    """One round: probe every static instance; register or heartbeat those that answered."""
    results = await asyncio.gather(
        *(probe(session, inst.spec.url, timeout_s) for inst in instances),
        return_exceptions=True,
    )
    raise_if_cancelling()
    registry = (await coordinator.snapshot()).by_id()
    for inst, result in zip(instances, results, strict=True):
        if isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, BaseException):
            if inst.answering is not False:
                log.warning(
                    "static instance %s (%s) does not answer: %s; not heartbeating it, so "
                    "it stops being alive after the instance TTL",
                    inst.spec.id,
                    inst.spec.url,
                    str(result) or type(result).__name__,
                )
            inst.answering = False
            continue
        if inst.answering is not True:
            log.info("static instance %s (%s) answers", inst.spec.id, inst.spec.url)
        inst.answering = True
        if not inst.model_from_flag and result is not None and result != inst.spec.model:
            inst.spec = replace(inst.spec, model=result)
        await _assert(coordinator, inst.spec, registry.get(inst.spec.id))


async def _assert(coordinator: Coordinator, spec: InstanceSpec, row: InstanceLoad | None) -> None:
    """Heartbeat the instance, or (re-)register it when the registry differs from the spec."""
    stored = row.spec if row is not None else None
    try:
        if stored is not None and stored.url == spec.url and stored.model == spec.model:
            try:
                await coordinator.heartbeat_instance(spec.id)
                return
            except UnknownInstanceError:
                pass  # unregistered since the snapshot: register below
        elif stored is not None and stored.url != spec.url:
            log.warning(
                "static instance %s was moved to %s in the registry; restoring %s",
                spec.id,
                stored.url,
                spec.url,
            )
        result = await coordinator.register_instance(spec)
        log.info(
            "static instance %s -> %s, model %s (%s)", spec.id, spec.url, spec.model, result.status
        )
    except CoordinatorError as exc:
        log.debug("keeping static instance %s alive failed: %s", spec.id, exc)


async def keep_alive(
    coordinator: Coordinator,
    session: aiohttp.ClientSession,
    instances: Sequence[StaticInstance],
    interval_s: float,
) -> None:
    """Run `maintain` every `interval_s` until cancelled; one failing round never ends it."""
    timeout_s = min(interval_s, PROBE_TIMEOUT_S)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await maintain(coordinator, session, instances, timeout_s)
        except Exception:
            log.exception("keeping the static instances alive failed")
        raise_if_cancelling()  # redis-py may have swallowed our cancel (coordinator.tasks)
