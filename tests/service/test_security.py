"""Security (docs/security.md): the control-plane token, a least-privilege Redis ACL,
Redis over TLS, no payload in Redis, logs or debug views, and the HTTP limits.

The ACL and TLS tests run on private servers started here (never the shared one):
ACLs and TLS are server-wide settings.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import io
import ipaddress
import json
import logging
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.errors import InvalidArgumentError
from coordinator.outliers import OutlierPolicy
from local_fleet.embedded import (
    EmbeddedRedis,
    ServerUnavailableError,
    find_server_binary,
    free_port,
)
from proxy_node.config import NodeConfig
from proxy_node.inspect import read_pool
from proxy_node.serve import HTTP_LIMITS, serve
from tests.fake_engine import FakeEngine, Harness, NodeServer, settled
from tests.helpers import delete_pool, wait_for
from tests.helpers import private_server as private_redis

pytestmark = pytest.mark.timeout(60)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "security.md"
TOKEN = "s3cret-token"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
VLLM_METRICS = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"


async def post_json(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with http.post(url, data=json.dumps(body).encode(), headers=headers or {}) as resp:
        return resp.status, await resp.json()


# ---------------------------------------------------------------------- the token

REFUSED_AUTHORIZATIONS = [
    None,  # no header
    "",
    "Bearer",
    "Bearer ",  # HTTP strips the trailing space: "Bearer"
    "Basic czNjcmV0LXRva2Vu",  # wrong scheme
    "Token s3cret-token",
    "bearer s3cret-token",  # the scheme must be written as documented
    "s3cret-token",  # no scheme
    "Bearer wrong-token",
    "Bearer s3cret-tokenX",
    "Bearer s3cret-toke",
    "Bearer  s3cret-token",  # whitespace inside the value
    "Bearer\ts3cret-token",
    "Bearer s3cret token",
    "Bearer s3cret-token s3cret-token",
    "Bearer tök",
    "Bearer " + "x" * 8000,  # very long, still under the header limit
]


async def write_statuses(
    harness: Harness, node: NodeServer, authorization: str | None
) -> list[tuple[int, Any, str | None]]:
    """(status, body, WWW-Authenticate) of each control-plane write."""
    headers = {} if authorization is None else {"Authorization": authorization}
    base = node.control_url + "/v1/instances"
    out = []
    for method, url, body in (
        ("POST", base, {"id": "e2", "url": "http://127.0.0.1:9"}),
        ("POST", base + "/e1/heartbeat", {"engine_running": 1}),
        ("DELETE", base + "/e1", None),
    ):
        data = None if body is None else json.dumps(body).encode()
        async with harness.http.request(method, url, data=data, headers=headers) as resp:
            out.append((resp.status, await resp.json(), resp.headers.get("WWW-Authenticate")))
    return out


async def test_every_refused_token_is_401_and_writes_nothing(harness: Harness) -> None:
    node = await harness.node(token=TOKEN)
    await node.coordinator.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:9"))
    before = await node.coordinator.redis.hgetall(node.coordinator.keys.column("last_seen_ms"))
    for authorization in REFUSED_AUTHORIZATIONS:
        for status, body, challenge in await write_statuses(harness, node, authorization):
            assert status == 401, (authorization, status, body)
            assert body["error"]["code"] == "unauthorized", body
            assert challenge == "Bearer"
    after = await node.coordinator.redis.hgetall(node.coordinator.keys.column("last_seen_ms"))
    assert after == before  # no registration, no heartbeat, no removal
    for path in ("/v1/instances", "/debug/instance_loads", "/debug/reservations", "/healthz"):
        async with harness.http.get(node.control_url + path) as resp:
            assert resp.status == 200, path  # reads stay open
    # Outer whitespace is not part of a header value (HTTP strips it): accepted.
    for authorization in (f"Bearer {TOKEN}", f"  Bearer {TOKEN}\t"):
        statuses = [s for s, _, _ in await write_statuses(harness, node, authorization)]
        assert statuses == [201, 200, 200], authorization
        await node.coordinator.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:9"))


async def test_the_token_is_compared_by_hmac_compare_digest(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await harness.node(token=TOKEN)
    calls: list[tuple[Any, Any]] = []
    verdict: Callable[[Any, Any], bool] = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return verdict(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    url = node.control_url + "/v1/instances"
    spec = {"id": "e1", "url": "http://127.0.0.1:9"}
    assert (await post_json(harness.http, url, spec, {"Authorization": "Bearer no"}))[0] == 401
    assert (await post_json(harness.http, url, spec, {"Authorization": f"Bearer {TOKEN}"}))[
        0
    ] == 201
    async with harness.http.get(url) as resp:
        assert resp.status == 200
    assert calls == [(b"Bearer no", f"Bearer {TOKEN}".encode()), (f"Bearer {TOKEN}".encode(),) * 2]
    # The verdict is compare_digest's alone: no other comparison decides.
    verdict = lambda a, b: True  # noqa: E731
    status, _ = await post_json(harness.http, url, {**spec, "id": "e2"}, {"Authorization": "x"})
    assert status == 201


def test_an_empty_token_cannot_be_configured() -> None:
    with pytest.raises(InvalidArgumentError, match="token"):
        NodeConfig(token="")
    assert NodeConfig.from_env({"COORD_TOKEN": ""}).token is None  # unset: open, and logged


# ---------------------------------------------------------------------- Redis ACL


def documented_acl_rule() -> list[str]:
    """The ACL SETUSER line of docs/security.md, as arguments after the user name."""
    lines = [line for line in DOCS.read_text().splitlines() if line.startswith("ACL SETUSER ")]
    assert len(lines) == 1, lines
    words = lines[0].split()
    assert words[:3] == ["ACL", "SETUSER", "coordinator"], words
    return words[3:]


def create_user(admin: SyncRedis, user: str, password: str) -> None:
    """Create the documented user, with its password, on a private server."""
    rule = [f">{password}" if w == ">CHANGE-ME" else w for w in documented_acl_rule()]
    assert f">{password}" in rule
    admin.execute_command("ACL", "SETUSER", user, "reset", *rule)


@pytest.fixture(scope="module")
def private_server() -> Iterator[EmbeddedRedis]:
    """A private server: ACLs are server-wide and must never touch the shared one."""
    with private_redis() as server:
        yield server


@dataclass
class AclSetup:
    url: str  # the restricted user's URL
    user: str
    admin: Redis


@pytest.fixture
async def acl(private_server: EmbeddedRedis) -> AsyncIterator[AclSetup]:
    password = uuid.uuid4().hex
    user = f"coord{uuid.uuid4().hex[:6]}"
    sync_admin = SyncRedis.from_url(private_server.url)
    create_user(sync_admin, user, password)
    sync_admin.close()
    admin = Redis.from_url(private_server.url, decode_responses=True)
    await admin.acl_log_reset()
    try:
        url = f"redis://{user}:{password}@127.0.0.1:{private_server.port}/0"
        yield AclSetup(url, user, admin)
    finally:
        await admin.acl_deluser(user)
        await admin.aclose()


async def lifecycle(url: str, pool: str) -> None:
    """Register, heartbeat, reserve, first token, release, snapshot, lease expiry and reap."""
    settings = Settings(redis_timeout_ms=2000, recovery_interval_ms=50)
    a = await Coordinator.connect(url, pool=pool, node_id="na", settings=settings, background=False)
    b = await Coordinator.connect(
        url, pool=pool, node_id="nb", settings=settings.with_(lease_ms=200), background=False
    )
    try:
        timing = {"prefill_ms_per_token": 0.1, "decode_ms_per_token": 1.0}
        await a.register_instance(InstanceSpec(id="i0", url="http://127.0.0.1:9", **timing))
        assert await a.heartbeat_instance("i0", {"engine_running": 1.0}) == 1
        res = await a.reserve(100, 10)
        assert await a.mark_first_token(res.rid)
        assert await a.release(res.rid)
        await b.reserve(100, 10)  # node b then stops renewing: its lease expires

        async def reaped() -> bool:
            return await a.reap_expired() == 1

        await wait_for(reaped, what="the expired node's reservation to be reaped")
        snap = await a.snapshot()
        assert [(r.id, r.inflight) for r in snap.rows] == [("i0", 0)]
        assert a.coordination == b.coordination == "ok"
    finally:
        await b.close()
        await a.close()


async def denied(admin: Redis) -> set[str]:
    """What ACL LOG recorded as refused commands or keys (not failed logins)."""
    return {e["object"] for e in await admin.acl_log() if e["reason"] in ("command", "key")}


async def test_documented_acl_runs_the_whole_lifecycle(acl: AclSetup, pool: str) -> None:
    await lifecycle(acl.url, pool)
    settings = Settings(redis_timeout_ms=2000, recovery_interval_ms=50)
    c = await Coordinator.connect(acl.url, pool=pool, node_id="nc", settings=settings)
    reservations = c.keys.column("reservations")
    try:
        await c.register_instance(InstanceSpec(id="i1", url="http://127.0.0.1:9"))
        await acl.admin.script_flush()  # NOSCRIPT: reloaded with SCRIPT LOAD
        kept = await c.reserve(10, 10)
        # Lock the user out and drop its connections: the node goes degraded...
        await acl.admin.execute_command("ACL", "SETUSER", acl.user, "off")
        await acl.admin.execute_command("CLIENT", "KILL", "USER", acl.user)
        await c.release(kept.rid)
        assert c.coordination == "degraded"
        assert await acl.admin.hlen(reservations) == 1
        # ...and re-asserts its state as that same user once it may log in again.
        await acl.admin.execute_command("ACL", "SETUSER", acl.user, "on")
        await wait_for(lambda: c.coordination == "ok", what="re-assertion under the ACL")
        assert await acl.admin.hlen(reservations) == 0
        state = await read_pool(c, settings)  # coordinator inspect's read
        assert {row["id"] for row in state.loads["instances"]} == {"i0", "i1"}
        await c.cordon("i1", "maintenance")  # an operator's drain: coordinator cordon
        await c.record_outcome("i1", True, OutlierPolicy())
        await c.cordon("i1", lift=True)
        await c.cordon("i1")
        await c.unregister_instance("i1")
    finally:
        await c.close()
    assert await denied(acl.admin) <= {"client|setinfo"}  # redis-py ignores that (Redis >= 7.2)


async def test_documented_acl_serves_a_proxy_node(acl: AclSetup, pool: str) -> None:
    harness = Harness(acl.url, pool)
    try:
        engine = await harness.engine(chunks=2, metrics_text=VLLM_METRICS)
        node = await harness.node(token=TOKEN, scrape_interval_s=0.05)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        spec = {"id": "e0", "url": engine.url}
        assert (await post_json(harness.http, node.control_url + "/v1/instances", spec, auth))[
            0
        ] == 201
        async with harness.http.post(node.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")

        async def scraped() -> bool:
            row = (await node.coordinator.snapshot()).by_id()["e0"]
            return row.engine_running == 2.0

        await wait_for(scraped, what="hints scraped under the ACL")
        for path in ("/debug/instance_loads", "/debug/reservations", "/v1/instances", "/metrics"):
            async with harness.http.get(node.control_url + path) as resp:
                assert resp.status == 200, path
        assert node.coordinator.coordination == "ok"
        reservations = node.coordinator.keys.column("reservations")

        async def released() -> bool:
            return await acl.admin.hlen(reservations) == 0

        await wait_for(released, what="the release")
    finally:
        await harness.close()
    # The harness's own clean-up (SCAN) is outside the rule; the node needed nothing else.
    assert await denied(acl.admin) <= {"client|setinfo", "scan"}
    await delete_pool(acl.admin, "lc", pool)


async def test_documented_acl_refuses_everything_else(acl: AclSetup, pool: str) -> None:
    client = Redis.from_url(acl.url, decode_responses=True)
    try:
        for command in (
            ("FLUSHALL",),
            ("KEYS", "*"),
            ("CONFIG", "GET", "*"),
            ("EVAL", "return 1", "0"),
        ):
            with pytest.raises(NoPermissionError):
                await client.execute_command(*command)
        with pytest.raises(NoPermissionError):
            await client.hset("outside:key", "f", "v")  # an allowed command, another key
        with pytest.raises(NoPermissionError):
            await client.hget("lcx:{p}:spec", "f")  # the prefix is `lc:`, not `lc`
        coordinator = Coordinator(client, pool=pool, settings=Settings(key_prefix="other"))
        with pytest.raises(NoPermissionError):
            await coordinator.scripts["read_state"](keys=coordinator.keys.columns, args=[1])
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- TLS


@dataclass
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (EC P-256)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coordinator test CA")])

    def builder(subject: Any, public_key: Any) -> Any:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        builder(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str, usage: Any, san: list[Any] | None) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = builder(subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if san:
            cert = cert.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, cert.sign(ca_key, hashes.SHA256())

    server_key, server_cert = leaf(
        "127.0.0.1",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    client_key, client_cert = leaf("coordinator", ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def write(name: str, obj: Any) -> Path:
        path = directory / name
        if hasattr(obj, "serial_number"):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(
                obj.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        return path

    return TlsFiles(
        write("ca.pem", ca),
        write("server.pem", server_cert),
        write("server.key", server_key),
        write("client.pem", client_cert),
        write("client.key", client_key),
    )


@dataclass
class TlsServer:
    port: int
    files: TlsFiles
    binary: str

    def url(self, *, user: str = "", ca: bool = True, client_cert: bool = True) -> str:
        """A rediss:// URL with the chosen credentials."""
        query = ["ssl_cert_reqs=required"]
        if ca:
            query.append(f"ssl_ca_certs={self.files.ca}")
        if client_cert:
            query += [
                f"ssl_certfile={self.files.client_cert}",
                f"ssl_keyfile={self.files.client_key}",
            ]
        return f"rediss://{user}127.0.0.1:{self.port}/0?" + "&".join(query)


TLS_UNSUPPORTED = re.compile(r"TLS|tls", re.IGNORECASE)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    """A private TLS-only server (--port 0) that requires client certificates."""
    try:
        binary = find_server_binary()
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server binary: {exc}")
    directory = tmp_path_factory.mktemp("tls")
    files = make_certificates(directory)
    port = free_port()
    log = directory / "server.log"
    args = [
        binary,
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
        *("--save", "", "--appendonly", "no", "--dir", str(directory)),
        *("--tls-cert-file", str(files.server_cert), "--tls-key-file", str(files.server_key)),
        *("--tls-ca-cert-file", str(files.ca), "--tls-auth-clients", "yes"),
        *("--logfile", str(log)),
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = TlsServer(port, files, binary)
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                text = log.read_text() if log.exists() else ""
                if TLS_UNSUPPORTED.search(text):
                    reason = text.strip().splitlines()[-1] if text.strip() else "no TLS"
                    pytest.skip(f"{binary} cannot serve TLS: {reason}")
                pytest.fail(f"{binary} exited at start: {text[-500:]}")
            try:
                client = SyncRedis.from_url(server.url(), socket_timeout=1)
                try:
                    if client.ping():
                        break
                finally:
                    client.close()
            except RedisConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{binary} did not answer over TLS on {port}")
                time.sleep(0.05)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_lifecycle_and_node_over_tls_as_the_acl_user(
    tls_server: TlsServer, pool: str
) -> None:
    admin = SyncRedis.from_url(tls_server.url(), socket_timeout=2)
    password = uuid.uuid4().hex
    create_user(admin, "coordinator", password)
    url = tls_server.url(user=f"coordinator:{password}@")
    try:
        await lifecycle(url, pool)
        harness = Harness(url, pool + "n")
        try:
            engine = await harness.engine(chunks=2)
            node = await harness.node()
            await node.coordinator.register_instance(InstanceSpec(id="e0", url=engine.url))
            async with harness.http.post(node.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            assert node.coordinator.coordination == "ok"
        finally:
            await harness.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "coordinator")
        admin.close()


@pytest.mark.parametrize(
    "variant", ["no client certificate", "no CA (system trust)", "plain redis://"]
)
def test_tls_refuses_unauthenticated_connections(tls_server: TlsServer, variant: str) -> None:
    if variant == "no client certificate":
        url = tls_server.url(client_cert=False)
    elif variant == "no CA (system trust)":
        url = tls_server.url(ca=False)
    else:
        url = f"redis://127.0.0.1:{tls_server.port}/0"
    client = SyncRedis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        with pytest.raises(RedisConnectionError):
            client.ping()
    finally:
        client.close()


# ---------------------------------------------------------------------- no payloads


class EchoEngine(FakeEngine):
    """A fake engine whose completions (and error bodies) repeat a marker."""

    marker: str = ""

    def _chunk(self, chat: bool, i: int | None) -> dict[str, Any]:
        chunk = super()._chunk(chat, i)
        choice = chunk["choices"][0]
        if i is not None:
            if chat:
                choice["delta"]["content"] = f"{self.marker} "
            else:
                choice["text"] = f"{self.marker} "
        return chunk

    def _full(self, chat: bool) -> dict[str, Any]:
        full = super()._full(chat)
        choice = full["choices"][0]
        if chat:
            choice["message"]["content"] = self.marker
        else:
            choice["text"] = self.marker
        return full


async def pool_contents(client: Redis, pattern: str) -> list[bytes]:
    """Every key name, decoded value and DUMP of the keys matching a pattern."""
    out: list[bytes] = []
    async for key in client.scan_iter(match=pattern, count=500):
        out.append(key)
        kind = await client.type(key)
        if kind == b"hash":
            for field, value in (await client.hgetall(key)).items():
                out += [field, value]
        elif kind == b"zset":
            out += [m for m, _ in await client.zrange(key, 0, -1, withscores=True)]
        elif kind == b"set":
            out += list(await client.smembers(key))
        dumped = await client.dump(key)
        if dumped is not None:
            out.append(dumped)
    return out


async def test_no_payload_reaches_redis_logs_or_debug_views(
    harness: Harness, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    marker = f"zq-private-{uuid.uuid4().hex}"
    engine = EchoEngine(chunks=3, gate_after=1)
    engine.marker = marker
    await engine.start()
    harness.engines.append(engine)
    timing = {"prefill_ms_per_token": 0.1, "prefill_overhead_ms": 5.0, "decode_ms_per_token": 2.0}
    node = await harness.node(token=TOKEN, scrape_interval_s=0.05)
    await node.coordinator.register_instance(InstanceSpec(id="e0", url=engine.url, **timing))
    raw = Redis.from_url(redis_url)
    seen: list[bytes] = []

    async def look() -> dict[str, bytes]:
        """Collect everything a payload could leak into, right now; return the views."""
        seen.extend(await pool_contents(raw, node.coordinator.keys.pattern()))
        seen.extend([k async for k in raw.scan_iter(match=f"*{marker}*", count=1000)])
        views = {}
        for base, path in (
            (node.control_url, "/debug/instance_loads"),
            (node.control_url, "/debug/reservations"),
            (node.control_url, "/v1/instances"),
            (node.control_url, "/metrics"),
            (node.control_url, "/healthz"),
            (node.url, "/metrics"),
            (node.url, "/healthz"),
        ):
            async with harness.http.get(base + path) as resp:
                assert resp.status == 200
                views[base + path] = await resp.read()
        seen.extend(views.values())
        return views

    # A system prompt of several whole prefix blocks: the prefix index records it.
    system = " ".join([marker] * 60)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": marker}]
    headers = {"X-Custom": marker, "User-Agent": "tester"}
    try:
        # In flight: the engine holds after its first chunk while we look.
        held = asyncio.ensure_future(
            harness.http.post(
                node.url + "/v1/chat/completions",
                json={"messages": messages, "stream": True, "user": marker},
                headers=headers,
            )
        )
        await wait_for(lambda: engine.active == 1, what="the request to reach the engine")
        views = await look()
        in_flight = json.loads(views[node.control_url + "/debug/reservations"])
        assert len(in_flight["reservations"]) == 1  # the held request's own
        engine.gate.set()
        async with await held as resp:
            assert marker.encode() in await resp.read()  # the client does get its answer
        engine.gate_after = None
        for path, body in (
            ("/v1/chat/completions", {"messages": messages, "stream": False, "user": marker}),
            ("/v1/completions", {"prompt": [marker, marker], "stream": True}),
            ("/v1/completions", {"prompt": marker, "max_tokens": 5}),
        ):
            async with harness.http.post(node.url + path, json=body, headers=headers) as resp:
                assert resp.status == 200
                assert marker.encode() in await resp.read()
        engine.status, engine.error_body = 500, json.dumps({"detail": marker}).encode()
        async with harness.http.post(node.url + "/v1/completions", json={"prompt": marker}) as resp:
            assert resp.status == 502  # the client sees the engine's error; nothing else does
        async with harness.http.post(
            node.url + "/v1/chat/completions", data=b'{"prompt": "' + marker.encode() + b'", oops'
        ) as resp:
            assert resp.status == 400
        await wait_for(lambda: settled(node.coordinator), what="every release")

        async def indexed() -> bool:  # the prefix index was exercised, and is looked at
            return bool(await raw.hlen(node.coordinator.keys.prefix_index()))

        await wait_for(indexed, what="the prefix index written")
        await look()
    finally:
        await raw.aclose()
    assert engine.requests == 5
    leaks = [blob[:200] for blob in seen if marker.encode() in blob]
    assert not leaks, leaks
    logged = [r.getMessage() for r in caplog.records if marker in r.getMessage()]
    assert not logged, logged
    assert caplog.records, "nothing was logged at all: the capture is not working"


# ---------------------------------------------------------------------- HTTP limits


@dataclass
class Served:
    """`coordinator serve`'s own serve() running in this process."""

    config: NodeConfig
    engine: FakeEngine
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.config.control_port}"


BODY_TIMEOUT_S = 0.5


@pytest.fixture
async def served(redis_url: str, pool: str) -> AsyncIterator[Served]:
    """A node started by proxy_node.serve.serve (the runners production uses)."""
    config = NodeConfig(
        redis_url=redis_url,
        pool=pool,
        port=free_port(),
        control_port=free_port(),
        token=TOKEN,
        max_body_bytes=4096,
        body_timeout_s=BODY_TIMEOUT_S,
        scrape_interval_s=0,
        settings=Settings(redis_timeout_ms=1000, instance_ttl_ms=600_000),
    )
    engine = await FakeEngine(chunks=2).start()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    http = aiohttp.ClientSession()
    node = Served(config, engine, http)
    try:

        async def up() -> bool:
            if task.done():
                task.result()  # raises what serve() failed with
            try:
                async with http.get(node.control_url + "/healthz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(up, what="serve() to answer")
        status, _ = await post_json(
            http,
            node.control_url + "/v1/instances",
            {"id": "e0", "url": engine.url},
            {"Authorization": f"Bearer {TOKEN}"},
        )
        assert status == 201
        yield node
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await http.close()
        await engine.stop()
        client = Redis.from_url(redis_url)
        await delete_pool(client, "lc", pool)
        await client.aclose()


def test_serve_sets_the_documented_parser_limits() -> None:
    assert HTTP_LIMITS == {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}
    text = DOCS.read_text()
    for value in ("8190 bytes", "| 128 |", "60 s", "8 MiB", "1 MiB"):
        assert value in text, value
    defaults = NodeConfig()
    assert (defaults.body_timeout_s, defaults.max_body_bytes) == (60.0, 8 * 1024 * 1024)


async def get_status(http: aiohttp.ClientSession, url: str, **kw: Any) -> int:
    async with http.get(url, **kw) as resp:
        await resp.read()
        return resp.status


async def test_oversized_request_heads_are_refused(served: Served) -> None:
    http = served.http
    for base in (served.url, served.control_url):
        assert await get_status(http, base + "/healthz", headers={"X-Big": "a" * 8000}) == 200
        assert await get_status(http, base + "/healthz", headers={"X-Big": "a" * 8300}) == 400
        many = {f"X-H{i}": "1" for i in range(130)}
        assert await get_status(http, base + "/healthz", headers=many) == 400
        assert await get_status(http, base + "/healthz?q=" + "a" * 8300) == 400
    chat = json.dumps(CHAT).encode()
    async with http.post(
        served.url + "/v1/chat/completions", data=chat, headers={"X-Big": "a" * 9000}
    ) as resp:
        assert resp.status == 400
    assert served.engine.requests == 0


async def test_oversized_bodies_are_413_json(served: Served) -> None:
    http = served.http
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    async with http.post(served.url + "/v1/chat/completions", data=big) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"
    spec = json.dumps({"id": "big", "url": "http://h:1", "model": "m" * 2**20}).encode()
    async with http.post(
        served.control_url + "/v1/instances",
        data=io.BytesIO(spec),  # aiohttp warns about large raw bytes bodies
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]
    assert served.engine.requests == 0


LINGERING_S = 10.0  # aiohttp's lingering_time: it drains an unread body this long, then closes


async def slow_request(url: str, path: str, extra: dict[str, str], trickle: bool) -> None:
    """Promise 1000 bytes of body, send a few (then trickle, or stall); check the 408 and close."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in extra.items()] + ["Content-Length: 1000", "", ""]
    writer.write("\r\n".join(head).encode() + b'{"messages": [')
    await writer.drain()

    async def trickling() -> None:
        for _ in range(2000):  # bounded; 1 byte per 10 ms outlasts the timeouts below
            await asyncio.sleep(0.01)
            if writer.is_closing() or reader.at_eof():
                return
            writer.write(b" ")

    feeder = asyncio.create_task(trickling()) if trickle else None
    try:
        # Generous bounds: the node answers after BODY_TIMEOUT_S and closes after at
        # most LINGERING_S more; a node that waited for the body forever fails here.
        async with asyncio.timeout(BODY_TIMEOUT_S + 10):
            status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines if line)
            body = json.loads(await reader.readexactly(int(headers["Content-Length"])))
        assert status_line.split()[1] == "408", (path, status_line, body)
        assert body["error"]["code"] == "body_timeout", body
        assert headers.get("Connection") == "close", headers
        # EOF right after the answer, while this client may still be sending: the node
        # half-closes and drains (errors.ClosingResponse). Closing the socket instead,
        # after aiohttp's lingering time, resets a client still sending (seen 1 in 12).
        async with asyncio.timeout(LINGERING_S / 2):
            assert await reader.read() == b""
    finally:
        if feeder is not None:
            feeder.cancel()
        writer.close()


async def test_slow_bodies_get_408_and_the_connection_closed(served: Served) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        (url, path, extra, trickle)
        for url, path, extra in (
            (served.url, "/v1/chat/completions", {}),
            (served.control_url, "/v1/instances", auth),
            (served.control_url, "/v1/instances/e0/heartbeat", auth),
        )
        for trickle in (False, True)
    ]
    # Concurrently: each connection waits out aiohttp's lingering close.
    await asyncio.gather(*(slow_request(*case) for case in cases))
    assert served.engine.requests == 0
    client = Redis.from_url(served.config.redis_url, decode_responses=True)
    try:
        reservations = f"lc:{{{served.config.pool}}}:reservations"
        assert await client.hlen(reservations) == 0
    finally:
        await client.aclose()


def test_config_rejects_a_bad_body_timeout() -> None:
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(InvalidArgumentError, match="body_timeout_s"):
            NodeConfig(body_timeout_s=bad)  # type: ignore[arg-type]
    assert NodeConfig.from_env({"COORD_BODY_TIMEOUT_S": "2.5"}).body_timeout_s == 2.5
