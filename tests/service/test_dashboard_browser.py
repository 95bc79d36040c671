"""The control plane's dashboard (`GET /ui`): its assets, and the page in a real browser.

The browser test drives Debian's headless chromium over the Chrome DevTools Protocol
(a websocket, spoken with aiohttp): no selenium, no driver binary. It is skipped when
no chromium is installed (`apt-get install -y chromium`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from coordinator import Coordinator
from proxy_node.app import create_app, create_control_app
from proxy_node.config import NodeConfig
from proxy_node.dashboard import add_dashboard_routes
from tests.fake_engine import FakeEngine, Harness, NodeServer
from tests.helpers import register_stale_instance, spec, wait_for

pytestmark = pytest.mark.timeout(60)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INTERVAL_MS = 200  # the page's refresh period in this test (?interval_ms=)
VIEWPORT = (1440, 900)
SECRET_PROMPT = "dashboard-must-never-show-this-prompt"


# ---------------------------------------------------------------- a minimal CDP client


class Browser:
    """Headless chromium with one page, driven over the DevTools websocket."""

    def __init__(self, proc: asyncio.subprocess.Process, http: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.http = http
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.session_id = ""
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def launch(cls, binary: str, profile: Path) -> Browser:
        """Start chromium, attach to a fresh page target."""
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--headless",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--hide-scrollbars",
            # Belt and braces next to the page's CSP: no host name resolves, so nothing
            # can leave the loopback address the node listens on.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--user-data-dir={profile}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        browser = cls(proc, aiohttp.ClientSession())
        try:
            ws_url = await asyncio.wait_for(browser._devtools_url(), 30)
            browser._tasks.append(asyncio.create_task(browser._drain_stderr()))
            browser.ws = await browser.http.ws_connect(ws_url, max_msg_size=0)
            browser._tasks.append(asyncio.create_task(browser._read()))
            target = await browser.send("Target.createTarget", {"url": "about:blank"}, page=False)
            attached = await browser.send(
                "Target.attachToTarget",
                {"targetId": target["targetId"], "flatten": True},
                page=False,
            )
            browser.session_id = attached["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                await browser.send(f"{domain}.enable")
            width, height = VIEWPORT
            await browser.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
        except BaseException:
            await browser.close()
            raise
        return browser

    async def _devtools_url(self) -> str:
        assert self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                raise RuntimeError("chromium exited before printing its DevTools URL")
            match = re.search(rb"DevTools listening on (ws://\S+)", line)
            if match:
                return match.group(1).decode()

    async def _drain_stderr(self) -> None:
        # An unread pipe would eventually block chromium's logging.
        assert self.proc.stderr is not None
        while await self.proc.stderr.readline():
            pass

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = json.loads(msg.data)
            future = self._pending.pop(doc.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(doc)
            elif "method" in doc:
                self.events.append(doc)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("DevTools websocket closed"))

    async def send(
        self, method: str, params: dict[str, Any] | None = None, *, page: bool = True
    ) -> dict[str, Any]:
        """One CDP command; its result, or an AssertionError with the protocol error."""
        assert self.ws is not None
        msg_id = next(self._ids)
        message: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self.session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        await self.ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, 20)
        if "error" in reply:
            raise AssertionError(f"{method} failed: {reply['error']}")
        result: dict[str, Any] = reply["result"]
        return result

    async def evaluate(self, expression: str) -> Any:
        """Evaluate JavaScript in the page and return its JSON value."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"page error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def navigate(self, url: str) -> None:
        """Load a URL and wait until the document has loaded."""
        await self.send("Page.navigate", {"url": url})
        await wait_for(
            lambda: self.evaluate("document.readyState === 'complete'"),
            timeout_s=15,
            what=f"{url} to load",
        )

    async def click(self, selector: str) -> None:
        """A real mouse click (press and release) in the middle of an element."""
        box = await self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
            )

    async def screenshot(self, path: Path) -> bytes:
        """Save a PNG of the viewport."""
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        data = base64.b64decode(shot["data"])
        await asyncio.to_thread(_write_file, path, data)
        return data

    def page_errors(self) -> list[str]:
        """Exceptions, console errors and browser-logged errors (CSP, failed loads)."""
        errors = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                errors.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                errors.append(json.dumps(params.get("args"))[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                errors.append(str(params["entry"].get("text"))[:500])
        return errors

    def requested(self, fragment: str) -> int:
        """How many requests the page has sent to URLs containing `fragment`."""
        return sum(
            1
            for event in self.events
            if event["method"] == "Network.requestWillBeSent"
            and fragment in event["params"]["request"]["url"]
        )

    async def close(self) -> None:
        """Close the websocket and end the chromium process this test started."""
        if self.ws is not None:
            await self.ws.close()
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.http.close()


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def chromium_binary() -> str | None:
    """The installed chromium (CHROMIUM env var first), or None."""
    for name in (os.environ.get("CHROMIUM", ""), *CHROMIUM_NAMES):
        if name and (found := shutil.which(name)):
            return found
    return None


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Browser]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium installed (apt-get install -y chromium)")
    b = await Browser.launch(binary, tmp_path / "profile")
    try:
        yield b
    finally:
        await b.close()


class DebugGate:
    """Middleware that can hold the debug views' answers, to pause mid-poll."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.waiting = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/debug/"):
            self.waiting += 1
            try:
                await self.open.wait()
            finally:
                self.waiting -= 1
        response: web.StreamResponse = await handler(request)
        return response


async def dashboard_node(
    harness: Harness, coordinator: Coordinator, gate: DebugGate | None = None
) -> NodeServer:
    """Like Harness.node, with its own control app so a gate can watch /debug polls."""
    cfg = NodeConfig(
        redis_url=harness.redis_url,
        pool=harness.pool,
        port=0,
        control_port=0,
        scrape_interval_s=0.0,
        settings=coordinator.settings,
    )
    app = create_app(cfg, coordinator)
    control = create_control_app(app)
    if gate is not None:
        control.middlewares.append(gate.middleware)
    runners, urls = [], []
    for application in (app, control):
        runner = web.AppRunner(application, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    node = NodeServer(coordinator, cfg, urls[0], urls[1], app, runners)
    harness.nodes.append(node)  # stopped by harness.close()
    return node


async def heartbeats(coordinator: Coordinator, engines: dict[str, FakeEngine]) -> None:
    """Keep the engines alive, reporting each one's running requests as a hint."""
    while True:
        for iid, engine in engines.items():
            await coordinator.heartbeat_instance(iid, {"engine_running": engine.active})
        await asyncio.sleep(0.5)


async def stream(http: aiohttp.ClientSession, url: str) -> int:
    """One streamed chat completion, read to the end (it blocks while the engine holds)."""
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "stream": True,
    }
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status


DOM_LOADS = """
(() => [...document.querySelectorAll('.bar[data-instance]')].map(bar => {
  const row = bar.closest('.row');
  const segs = [...bar.querySelectorAll('.seg')];
  return {
    id: bar.dataset.instance,
    inflight: bar.dataset.inflight === '' ? null : Number(bar.dataset.inflight),
    total: bar.dataset.total === '' ? null : Number(bar.dataset.total),
    state: row.querySelector('.state').textContent,
    alive: row.dataset.alive,
    totalText: row.querySelector('.total').textContent,
    inflightText: row.querySelector('.inflight').textContent,
    segSum: segs.reduce((s, seg) => s + Number(seg.dataset.value), 0),
    widthPct: segs.reduce((s, seg) => s + parseFloat(seg.style.width || '0'), 0),
    sparkSamples: Number(row.querySelector('canvas.spark').dataset.samples || 0),
    rowHeight: row.getBoundingClientRect().height,
  };
}))()
"""

DOM_STATUS = """
(() => ({
  state: document.getElementById('status').dataset.state,
  ticks: Number(document.getElementById('status').dataset.ticks),
  pause: document.getElementById('pause').textContent,
  pressed: document.getElementById('pause').getAttribute('aria-pressed'),
  node: document.getElementById('node-id').textContent,
  pool: document.getElementById('pool').textContent,
  coordination: document.getElementById('coordination').textContent,
  reservations: [...document.querySelectorAll('#reservations tbody tr')].map(tr =>
    [...tr.children].map(td => td.textContent)),
  text: document.body.innerText,
}))()
"""


# ---------------------------------------------------------------- tests


async def test_ui_assets_are_served_self_contained() -> None:
    app = web.Application()
    add_dashboard_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    expected = {
        "/ui": "text/html",
        "/ui/dashboard.js": "text/javascript",
        "/ui/dashboard.css": "text/css",
    }
    try:
        async with aiohttp.ClientSession() as http:
            bodies = {}
            for path, content_type in expected.items():
                async with http.get(base + path) as resp:
                    assert resp.status == 200, path
                    assert resp.content_type == content_type, (path, resp.content_type)
                    assert resp.charset == "utf-8"
                    csp = resp.headers["Content-Security-Policy"]
                    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
                    assert resp.headers["X-Content-Type-Options"] == "nosniff"
                    bodies[path] = await resp.text()
            async with http.get(base + "/ui/", allow_redirects=False) as resp:
                assert resp.status == 302 and resp.headers["Location"] == "../ui"
            async with http.get(base + "/ui/nothing.js") as resp:
                assert resp.status == 404
    finally:
        await runner.cleanup()
    for path, text in bodies.items():
        # Nothing fetched from outside: no absolute URL of any scheme, no CDN.
        assert not re.search(r"https?:", text, re.IGNORECASE), path
        assert "//cdn" not in text.lower(), path
    html = bodies["/ui"]
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sorted(refs) == ["data:,", "ui/dashboard.css", "ui/dashboard.js"]
    js = bodies["/ui/dashboard.js"]
    fetched = set(re.findall(r'[`"](debug/[a-z_]+)', js))
    assert fetched == {"debug/instance_loads", "debug/reservations"}  # relative, same origin
    for hook in ('id="status"', 'id="pause"', 'id="instances"', 'id="reservations"'):
        assert hook in html


async def test_dashboard_in_a_browser(
    harness: Harness, browser: Browser, redis_url: str, pool: str
) -> None:
    await register_stale_instance(redis_url, pool, "engine-gone")
    coordinator = await harness.coordinator(node_id="node-ui")
    engines: dict[str, FakeEngine] = {}
    for k in range(4):
        # Two engines hold before their first chunk (prefill), two after it (decode).
        engine = await harness.engine(chunks=3, gate_after=k % 2)
        iid = f"engine-{k}"
        await coordinator.register_instance(spec(iid, url=engine.url))
        engines[iid] = engine
    gate = DebugGate()
    node = await dashboard_node(harness, coordinator, gate)
    beats = asyncio.create_task(heartbeats(coordinator, engines))
    requests: list[asyncio.Task[int]] = []

    async def add_load(n: int) -> None:
        before = sum(e.active for e in engines.values())
        requests.extend(asyncio.create_task(stream(harness.http, node.url)) for _ in range(n))
        await wait_for(
            lambda: sum(e.active for e in engines.values()) == before + n,
            what=f"{before + n} streams held by the engines",
        )

    async def dom_matches_engines() -> bool:
        loads = {row["id"]: row for row in await browser.evaluate(DOM_LOADS)}
        return all(loads.get(iid, {}).get("inflight") == e.active for iid, e in engines.items())

    try:
        await add_load(4)
        await browser.navigate(f"{node.control_url}/ui?interval_ms={INTERVAL_MS}")
        assert await browser.evaluate("document.title.startsWith('coordinator')"), "no dashboard"
        await wait_for(dom_matches_engines, timeout_s=10, what="bars showing the held streams")

        loads = {row["id"]: row for row in await browser.evaluate(DOM_LOADS)}
        assert set(loads) == {*engines, "engine-gone"}
        status = await browser.evaluate(DOM_STATUS)
        assert (status["node"], status["pool"], status["coordination"]) == ("node-ui", pool, "ok")
        assert status["state"] == "live" and status["pause"] == "Pause"
        assert loads["engine-gone"]["state"] == "stale" and loads["engine-gone"]["total"] is None
        for iid in engines:
            row = loads[iid]
            assert row["state"] == "alive" and row["alive"] == "true"
            assert row["inflightText"] == str(engines[iid].active)
            # The stacked segments add up to the score total (weights are 1 here).
            assert row["segSum"] == pytest.approx(row["total"], rel=1e-9, abs=1e-9)
            assert row["totalText"] == f"{row['total']:.2f}"
        busiest = max(loads[iid]["total"] for iid in engines)
        for iid in engines:
            expected_pct = 100 * loads[iid]["total"] / busiest
            assert loads[iid]["widthPct"] == pytest.approx(expected_pct, abs=0.01)

        # More load: the page follows without a reload.
        ticks_before = status["ticks"]
        await add_load(4)
        await wait_for(dom_matches_engines, timeout_s=10, what="bars following the new load")
        status = await browser.evaluate(DOM_STATUS)
        assert status["ticks"] > ticks_before
        await wait_for(
            lambda: _reservation_rows_match(browser, 8),
            timeout_s=10,
            what="8 reservation rows",
        )
        status = await browser.evaluate(DOM_STATUS)
        for rid, instance, node_id, phase, age in status["reservations"]:
            assert instance in engines and node_id == "node-ui", (rid, instance, node_id)
            assert phase in ("prefill", "decode") and int(age) >= 0
        assert {row[3] for row in status["reservations"]} == {"prefill", "decode"}
        assert SECRET_PROMPT not in status["text"]  # numbers and ids only, never payloads
        await wait_for(
            lambda: _min_spark_samples(browser, 3),
            timeout_s=10,
            what="sparklines with a few samples",
        )
        shot = await browser.screenshot(ARTIFACTS / "dashboard.png")
        assert shot.startswith(b"\x89PNG")

        # Pause between polls: the page stops asking; resume starts again.
        await browser.click("#pause")
        await wait_for(
            lambda: _status_is(browser, "paused", "Resume", "true"),
            timeout_s=5,
            what="the paused state",
        )
        sent = browser.requested("/debug/")
        ticks = (await browser.evaluate(DOM_STATUS))["ticks"]
        await asyncio.sleep(5 * INTERVAL_MS / 1000)  # observation window (see below)
        assert browser.requested("/debug/") == sent
        assert (await browser.evaluate(DOM_STATUS))["ticks"] == ticks
        await browser.click("#pause")
        await wait_for(
            lambda: _ticks_above(browser, ticks + 1), timeout_s=5, what="polling to resume"
        )

        # Pause while a poll is in flight (its answers held back): no request leaves
        # the page afterwards, and neither that late answer nor the load going away
        # changes the DOM; resume catches up.
        gate.open.clear()
        await wait_for(lambda: gate.waiting > 0, timeout_s=5, what="a poll in flight")
        frozen = await browser.evaluate(DOM_LOADS)
        frozen_ticks = (await browser.evaluate(DOM_STATUS))["ticks"]
        await browser.click("#pause")
        await wait_for(
            lambda: _status_is(browser, "paused", "Resume", "true"),
            timeout_s=5,
            what="the paused state",
        )
        sent = browser.requested("/debug/")
        for engine in engines.values():
            engine.gate.set()
        assert all(status == 200 for status in await asyncio.gather(*requests))
        await wait_for(
            lambda: _redis_idle(coordinator, engines), timeout_s=10, what="the load to drain"
        )
        gate.open.set()  # the held poll now answers with the drained pool
        await wait_for(lambda: gate.waiting == 0, timeout_s=5, what="held polls answered")
        # An observation window, not a readiness wait: five refresh periods in which a
        # page that ignored the pause would have polled and redrawn.
        await asyncio.sleep(5 * INTERVAL_MS / 1000)
        assert browser.requested("/debug/") == sent
        assert (await browser.evaluate(DOM_STATUS))["ticks"] == frozen_ticks
        assert await browser.evaluate(DOM_LOADS) == frozen

        await browser.click("#pause")
        await wait_for(
            lambda: _status_is(browser, "live", "Pause", "false"), timeout_s=5, what="resume"
        )
        await wait_for(dom_matches_engines, timeout_s=10, what="bars back to idle")
        assert all(row["inflight"] == 0 for row in await browser.evaluate(DOM_LOADS))
        await wait_for(
            lambda: _reservation_rows_match(browser, 0), timeout_s=10, what="no reservations"
        )

        # 64 instances stay readable: compact rows in a scrolling list, no page overflow.
        for k in range(59):
            await coordinator.register_instance(spec(f"pad-{k:02d}", url="http://127.0.0.1:9"))
        await wait_for(lambda: _bar_count(browser, 64), timeout_s=10, what="64 instance bars")
        layout = await browser.evaluate(
            """(() => { const list = document.getElementById('instances');
               return {scrolls: list.scrollHeight > list.clientHeight,
                       fits: list.getBoundingClientRect().bottom <= window.innerHeight,
                       overflowX: document.documentElement.scrollWidth > window.innerWidth}; })()"""
        )
        assert layout == {"scrolls": True, "fits": True, "overflowX": False}
        assert max(row["rowHeight"] for row in await browser.evaluate(DOM_LOADS)) <= 24
        await browser.screenshot(ARTIFACTS / "dashboard_64.png")

        # An operator's cordon: the row says so, and the pool's counts too.
        await coordinator.cordon("pad-00", "upgrade")  # the node reads it within a second

        async def pad_00_cordoned() -> bool:
            rows = {row["id"]: row for row in await browser.evaluate(DOM_LOADS)}
            return rows["pad-00"]["state"] == "cordoned"

        await wait_for(pad_00_cordoned, timeout_s=10, what="the cordoned row")
        count = await browser.evaluate("document.getElementById('instance-count').textContent")
        assert count.endswith(", 1 cordoned"), count

        # Fewer rows than the pool has (?limit=): the best ranked shown, counts whole.
        await browser.navigate(f"{node.control_url}/ui?interval_ms={INTERVAL_MS}&limit=8")
        await wait_for(lambda: _bar_count(browser, 8), timeout_s=10, what="8 instance bars")
        count = await browser.evaluate("document.getElementById('instance-count').textContent")
        assert re.fullmatch(r"\d+ alive / 64, 1 cordoned \(the best 8 shown\)", count), count
        shown = {row["id"] for row in await browser.evaluate(DOM_LOADS)}
        # dead and cordoned ones rank last
        assert not {"engine-gone", "pad-00"} & shown and len(shown) == 8
        assert browser.page_errors() == []
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beats
        for engine in engines.values():
            engine.gate.set()
        await asyncio.gather(*requests, return_exceptions=True)


async def _reservation_rows_match(browser: Browser, n: int) -> bool:
    return len((await browser.evaluate(DOM_STATUS))["reservations"]) == n


async def _min_spark_samples(browser: Browser, n: int) -> bool:
    loads = await browser.evaluate(DOM_LOADS)
    return all(row["sparkSamples"] >= n for row in loads if row["alive"] == "true")


async def _status_is(browser: Browser, state: str, label: str, pressed: str) -> bool:
    status = await browser.evaluate(DOM_STATUS)
    return (status["state"], status["pause"], status["pressed"]) == (state, label, pressed)


async def _ticks_above(browser: Browser, n: int) -> bool:
    return int((await browser.evaluate(DOM_STATUS))["ticks"]) > n


async def _bar_count(browser: Browser, n: int) -> bool:
    return int(await browser.evaluate("document.querySelectorAll('.bar').length")) == n


async def _redis_idle(coordinator: Coordinator, engines: dict[str, FakeEngine]) -> bool:
    snap = await coordinator.snapshot()
    return all(row.inflight == 0 for row in snap.rows) and not any(
        e.active for e in engines.values()
    )
