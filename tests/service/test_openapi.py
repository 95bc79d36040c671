"""proxy_node/openapi.yaml: a valid OpenAPI 3.0 document that matches the code and the running node.

- structure: required keys, unique operation ids, every $ref resolves, writes carry
  the bearer scheme and reads none; with openapi-spec-validator, full validation;
- agreement with the code: InstanceSpec's fields, hint names, strategies and the id
  pattern come from coordinator/, and every control-plane route is documented;
- the running node: each documented operation is called with the document's own
  examples (and the error cases it lists); every answer's status is one the
  operation documents, its JSON body validates against that response's schema, and
  every documented status except 408 and 503 is seen (those two are covered by
  tests/service/test_security.py and the Redis fault tests).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import AsyncIterator
from dataclasses import fields
from importlib.resources import files
from typing import Any

import aiohttp
import pytest
import yaml

from coordinator import InstanceSpec
from coordinator.keys import ID_RE
from coordinator.models import (
    HINT_NAMES,
    MAX_MS_PER_TOKEN,
    MAX_OVERHEAD_MS,
    MAX_SLOTS,
    MAX_WEIGHT,
    ROLES,
)
from coordinator.settings import STRATEGIES
from proxy_node.app import create_app, create_control_app
from proxy_node.config import NodeConfig
from tests.fake_engine import Harness, NodeServer

pytestmark = pytest.mark.timeout(60)

TOKEN = "openapi-token"
METHODS = ("get", "put", "post", "delete", "patch")
STATIC_PREFIX = "/ui"  # the dashboard's static files: not API
NOT_TRIGGERED_HERE = {"408", "503"}  # body timeout and Redis down: tested elsewhere


def load() -> dict[str, Any]:
    """The document as shipped in the package."""
    text = files("proxy_node").joinpath("openapi.yaml").read_text(encoding="utf-8")
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


DOC = load()


def resolve(node: Any, doc: dict[str, Any] = DOC) -> Any:
    """The node with every local $ref replaced by its target (the document has no cycles)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None:
            assert ref.startswith("#/"), ref
            target: Any = doc
            for part in ref[2:].split("/"):
                target = target[part]
            return resolve(target, doc)
        return {k: resolve(v, doc) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, doc) for v in node]
    return node


def operations() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """operationId -> (method, path, operation)."""
    out = {}
    for path, item in DOC["paths"].items():
        for method in METHODS:
            if method in item:
                op = item[method]
                assert op["operationId"] not in out, op["operationId"]
                out[op["operationId"]] = (method, path, op)
    return out


OPERATIONS = operations()


# ---------------------------------------------------------------------- the document


def test_document_structure() -> None:
    assert DOC["openapi"].startswith("3.0.")
    assert DOC["info"]["title"] and DOC["info"]["version"]
    assert DOC["servers"] and DOC["paths"]
    scheme = DOC["components"]["securitySchemes"]["bearerToken"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    resolve(DOC)  # every $ref resolves
    for op_id, (method, path, op) in OPERATIONS.items():
        assert op["summary"] and op["responses"], op_id
        for status, response in op["responses"].items():
            assert re.fullmatch(r"[1-5]\d\d", status), (op_id, status)
            response = resolve(response)
            assert response["description"], (op_id, status)
            for media, content in response.get("content", {}).items():
                assert "schema" in content, (op_id, status, media)
            # A draining node's 503 is its health document: probes and operators read it.
            if status >= "400" and (op_id, status) != ("healthz", "503"):
                schema = response["content"]["application/json"]["schema"]
                assert schema == resolve({"$ref": "#/components/schemas/Error"}), (op_id, status)
        writes = method != "get"
        assert op["security"] == ([{"bearerToken": []}] if writes else []), op_id
        if writes:
            assert "401" in op["responses"], op_id
        for name in re.findall(r"{(\w+)}", path):
            params = [resolve(p) for p in op.get("parameters", [])]
            assert any(p["name"] == name and p["in"] == "path" for p in params), (op_id, name)


def test_document_is_valid_openapi() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(DOC)


def test_schemas_match_the_code() -> None:
    schemas = DOC["components"]["schemas"]
    spec = schemas["InstanceSpec"]
    assert set(spec["properties"]) == {f.name for f in fields(InstanceSpec)}
    assert spec["required"] == ["id", "url"] and spec["additionalProperties"] is False
    assert spec["properties"]["role"]["enum"] == list(ROLES)
    assert set(schemas["Hints"]["properties"]) == set(HINT_NAMES)
    assert schemas["Strategy"]["enum"] == list(STRATEGIES)
    # The same id rule: ECMA `^...$` in the document, Python `...\Z` in the code.
    assert schemas["Id"]["pattern"] == "^" + ID_RE.pattern.removesuffix("\\Z") + "$"
    props = spec["properties"]
    assert props["max_slots"]["maximum"] == MAX_SLOTS
    assert props["weight"]["maximum"] == MAX_WEIGHT
    for name in ("prefill_ms_per_token", "decode_ms_per_token"):
        assert props[name]["maximum"] == MAX_MS_PER_TOKEN, name
    assert props["prefill_overhead_ms"]["maximum"] == MAX_OVERHEAD_MS
    defaults = InstanceSpec(id="x", url="http://h")
    for name, prop in spec["properties"].items():
        if "default" in prop:
            value = getattr(defaults, name)
            assert prop["default"] == (list(value) if isinstance(value, tuple) else value), name


def test_every_control_route_is_documented() -> None:
    service = create_app(NodeConfig(port=0, control_port=0))
    control = create_control_app(service)
    served = set()
    for route in control.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD" or path.startswith(STATIC_PREFIX):
            continue
        served.add((route.method.lower(), path))
    documented = {(method, path) for method, path, _ in OPERATIONS.values()}
    assert served == documented


# ---------------------------------------------------------------------- the running node


class Checker:
    """Calls the node and checks each answer against the document."""

    def __init__(self, harness: Harness, node: NodeServer) -> None:
        self.harness = harness
        self.node = node
        self.seen: dict[str, set[str]] = {op_id: set() for op_id in OPERATIONS}

    async def call(
        self,
        op_id: str,
        *,
        params: dict[str, str] | None = None,
        query: dict[str, str] | None = None,
        body: Any = None,
        raw: bytes | None = None,
        token: bool = True,
        expect: int | None = None,
    ) -> Any:
        """Call one operation; check status and body against the document; return the body."""
        method, path, op = OPERATIONS[op_id]
        for name, value in (params or {}).items():
            path = path.replace("{" + name + "}", value)
        headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        payload: Any = data
        if data is not None:
            headers["Content-Type"] = "application/json"
            # aiohttp warns about large raw bytes bodies; a file object is streamed.
            payload = io.BytesIO(data) if len(data) > 2**16 else data
        url = self.node.control_url + path
        async with self.harness.http.request(
            method.upper(), url, params=query, data=payload, headers=headers
        ) as resp:
            status, text, resp_headers = resp.status, await resp.read(), resp.headers
        documented = op["responses"]
        assert str(status) in documented, (op_id, status, text[:300])
        if expect is not None:
            assert status == expect, (op_id, status, text[:300])
        self.seen[op_id].add(str(status))
        response = resolve(documented[str(status)])
        for name in response.get("headers", {}):
            assert name in resp_headers, (op_id, status, name)
        content = response.get("content", {})
        media = resp_headers.get("Content-Type", "").split(";")[0].strip()
        assert media in content, (op_id, status, media, sorted(content))
        if media == "application/json":
            doc = json.loads(text)
            validate(content[media]["schema"], doc, f"{op_id} {status}")
            return doc
        return text.decode()

    def examples(self, op_id: str) -> list[tuple[Any, int]]:
        """(value, expected status) of an operation's request examples, in order."""
        op = OPERATIONS[op_id][2]
        body = op["requestBody"]["content"]["application/json"]
        return [(e["value"], e["x-status"]) for e in body["examples"].values()]

    def param_example(self, op_id: str, name: str) -> str:
        for param in OPERATIONS[op_id][2].get("parameters", []):
            param = resolve(param)
            if param["name"] == name:
                return str(param["example"])
        raise AssertionError(f"{op_id} has no example for {name}")


def validate(schema: dict[str, Any], instance: Any, where: str) -> None:
    """Validate a JSON document against an OpenAPI 3.0 schema (nullable included)."""
    module = pytest.importorskip("openapi_schema_validator")
    errors = [e.message for e in module.OAS30Validator(schema).iter_errors(instance)]
    assert not errors, (where, errors[:5], json.dumps(instance)[:500])


@pytest.fixture
async def checker(redis_url: str, pool: str) -> AsyncIterator[Checker]:
    harness = Harness(redis_url, pool)
    try:
        coordinator = await harness.coordinator(instance_ttl_ms=600_000)
        node = await harness.node(coordinator, token=TOKEN)
        yield Checker(harness, node)
    finally:
        await harness.close()


async def test_running_node_matches_the_document(checker: Checker) -> None:
    c = checker
    for value, status in c.examples("registerInstance"):
        await c.call("registerInstance", body=value, expect=status)
    instance_id = c.param_example("heartbeatInstance", "instance_id")
    for value, status in c.examples("heartbeatInstance"):
        await c.call(
            "heartbeatInstance", params={"instance_id": instance_id}, body=value, expect=status
        )
    await c.call("heartbeatInstance", params={"instance_id": instance_id}, expect=200)  # no body
    listed = await c.call("listInstances", query={"include_dead": "true"}, expect=200)
    assert [i["id"] for i in listed["instances"]] == [instance_id]

    # A live reservation, so that the debug views have rows to describe.
    reservation = await c.node.coordinator.reserve(100, 20)
    strategy = c.param_example("instanceLoads", "strategy")
    loads = await c.call("instanceLoads", query={"strategy": strategy}, expect=200)
    assert loads["instances"][0]["least_load_score"] is not None
    limit = c.param_example("reservations", "limit")
    rows = await c.call("reservations", query={"limit": limit}, expect=200)
    assert [r["rid"] for r in rows["reservations"]] == [reservation.rid]
    await c.node.coordinator.release(reservation.rid)
    await c.call("healthz", expect=200)
    assert "proxy_" in await c.call("metrics", expect=200)

    # The error answers each operation documents.
    await c.call("registerInstance", body={"id": "x", "url": "http://h:1"}, token=False, expect=401)
    await c.call("registerInstance", raw=b"{not json", expect=400)
    await c.call(
        "registerInstance", raw=b'{"id": "big", "url": "' + b"u" * 2**20 + b'"}', expect=413
    )
    await c.call("heartbeatInstance", params={"instance_id": "nobody"}, expect=404)
    await c.call("heartbeatInstance", params={"instance_id": "x"}, token=False, expect=401)
    await c.call("heartbeatInstance", params={"instance_id": instance_id}, raw=b"[", expect=400)
    await c.call(
        "heartbeatInstance", params={"instance_id": instance_id}, raw=b"x" * (2**20 + 1), expect=413
    )
    on = {"instance_id": instance_id}
    for value, status in c.examples("cordonInstance"):
        answer = await c.call("cordonInstance", params=on, body=value, expect=status)
        if status == 200:
            assert answer == {
                "instance_id": instance_id,
                "cordoned": True,
                "reason": value["reason"],
                "inflight": 0,
            }
    listed = await c.call("listInstances", expect=200)
    assert [i["cordoned"] for i in listed["instances"]] == [True]
    await c.call("cordonInstance", params=on, expect=200)  # no body: no reason
    await c.call("cordonInstance", params={"instance_id": "nobody"}, expect=404)
    await c.call("cordonInstance", params=on, token=False, expect=401)
    await c.call("uncordonInstance", params=on, token=False, expect=401)
    await c.call("uncordonInstance", params={"instance_id": "nobody"}, expect=404)
    lifted = await c.call("uncordonInstance", params=on, expect=200)
    assert lifted["cordoned"] is False and lifted["reason"] is None
    await c.call("instanceLoads", query={"strategy": "bogus"}, expect=400)
    await c.call("reservations", query={"limit": "0"}, expect=400)
    await c.call("unregisterInstance", params={"instance_id": instance_id}, token=False, expect=401)
    await c.call("unregisterInstance", params={"instance_id": instance_id}, expect=200)
    await c.call("unregisterInstance", params={"instance_id": instance_id}, expect=404)

    for op_id, (_, _, op) in OPERATIONS.items():
        missing = set(op["responses"]) - c.seen[op_id] - NOT_TRIGGERED_HERE
        assert not missing, f"{op_id}: documented {sorted(missing)} never seen"


async def test_documented_defaults_are_what_the_node_applies(checker: Checker) -> None:
    await checker.call(
        "registerInstance", body={"id": "d1", "url": "http://127.0.0.1:9"}, expect=201
    )
    listed = await checker.call("listInstances", expect=200)
    row = listed["instances"][0]
    props = DOC["components"]["schemas"]["InstanceSpec"]["properties"]
    assert row["role"] == props["role"]["default"]
    assert row["weight"] == props["weight"]["default"]
    assert row["max_slots"] == props["max_slots"]["default"]
    assert row["epoch"] == 1  # epoch 0 (the default) means "new: 1"
    async with aiohttp.ClientSession() as http:
        url = checker.node.control_url + "/v1/instances/d1"
        async with http.delete(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200
