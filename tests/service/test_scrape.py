"""/metrics renders: one at a time, shared by the scrapes waiting, never older than
the scrape (proxy_node/scrape.py), so a flood of GETs on the public service plane
costs a bounded number of pool reads and renders."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from coordinator import Coordinator, InstanceSpec
from coordinator.snapshot import Snapshot
from proxy_node.scrape import SharedRender, SharedRenders, pause_after
from proxy_node.state import SCRAPES
from tests.fake_engine import Harness


class Renders:
    """A render function that counts its calls, names each body by its call, and can be
    held (until `release`) or made to fail; with a fake clock and a fake sleep."""

    def __init__(self, took_s: float = 0.0) -> None:
        self.calls = 0
        self.took_s = took_s
        self.now = 100.0
        self.slept: list[float] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = False

    def hold(self) -> None:
        self.gate = asyncio.Event()

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self.gate = None

    async def render(self) -> bytes:
        self.calls += 1
        call = self.calls
        if self.gate is not None:
            await self.gate.wait()
        self.now += self.took_s
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("render failed")
        return f"render {call}".encode()

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # as a real sleep does, let other scrapes arrive meanwhile

    def shared(self, **kwargs: float) -> SharedRender:
        return SharedRender(self.render, clock=lambda: self.now, sleep=self.sleep, **kwargs)


def counted_reads(coordinator: Coordinator) -> list[int]:
    """Counts the coordinator's reads of the pool (`snapshot()`) from now on, in [0]."""
    reads = [0]
    snapshot = coordinator.snapshot

    async def counted() -> Snapshot:
        reads[0] += 1
        return await snapshot()

    coordinator.snapshot = counted  # type: ignore[method-assign]
    return reads


async def running(task: asyncio.Task[bytes], renders: Renders, calls: int) -> None:
    """Let the loop run until `renders` has been called `calls` times."""
    for _ in range(100):
        if renders.calls >= calls:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{renders.calls} renders, expected {calls} ({task!r})")


async def test_scrapes_during_a_render_share_the_next_one_and_never_get_an_older_one() -> None:
    renders = Renders()
    shared = renders.shared(min_gap_s=0.0)
    renders.hold()
    first = asyncio.create_task(shared.get())
    await running(first, renders, 1)
    # Ten scrapes arrive while render 1 runs: it read the pool before they came.
    later = [asyncio.create_task(shared.get()) for _ in range(10)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert renders.calls == 1  # they wait; none renders beside it
    renders.release()
    assert await first == b"render 1"
    assert await asyncio.gather(*later) == [b"render 2"] * 10
    assert renders.calls == 2


async def test_scrapes_that_arrive_before_a_render_starts_all_take_it() -> None:
    renders = Renders(took_s=0.01)
    shared = renders.shared(min_gap_s=0.0)
    assert await shared.get() == b"render 1"
    # All arrive together, before the next render starts (it waits out its pause).
    bodies = await asyncio.gather(*(shared.get() for _ in range(20)))
    assert bodies == [b"render 2"] * 20
    assert renders.calls == 2


async def test_the_next_render_waits_its_pause_after_the_last_one() -> None:
    renders = Renders(took_s=0.2)
    shared = renders.shared(min_gap_s=0.05, idle_ratio=3.0)
    await shared.get()
    assert renders.slept == []  # the first render waits for nothing
    renders.now += 0.1  # 0.1 s after it ended: 0.5 s of its 0.6 s pause are left
    await shared.get()
    assert renders.slept == [pytest.approx(0.5)]
    renders.now += 10.0  # long after: no wait
    await shared.get()
    assert renders.slept == [pytest.approx(0.5)]
    assert renders.calls == 3


def test_the_pause_is_the_longer_of_the_gap_and_the_idle_share() -> None:
    assert pause_after(0.001, min_gap_s=0.05, idle_ratio=3.0) == 0.05
    assert pause_after(0.75, min_gap_s=0.05, idle_ratio=3.0) == pytest.approx(2.25)


async def test_a_failed_render_is_served_to_no_one_and_the_next_scrape_renders_again() -> None:
    renders = Renders()
    shared = renders.shared(min_gap_s=0.0)
    assert await shared.get() == b"render 1"
    renders.fail_next = True
    with pytest.raises(RuntimeError):
        await shared.get()
    assert await shared.get() == b"render 3"


async def test_a_flood_of_scrapes_reads_the_pool_a_bounded_number_of_times(
    harness: Harness,
) -> None:
    engine = await harness.engine()
    node = await harness.node()
    await node.coordinator.register_instance(InstanceSpec(id="e0", url=engine.url))
    shared = node.app[SCRAPES]
    reads = counted_reads(node.coordinator)
    before = shared.started

    async def scrape(url: str) -> str:
        async with harness.http.get(url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    # Both planes serve the same renders.
    urls = [node.url, node.control_url] * 20
    bodies = await asyncio.gather(*(scrape(url) for url in urls))
    assert all('instance="e0"' in body for body in bodies)
    renders = shared.started - before
    # 40 scrapes at once: the first render, and one for all that came during it.
    assert 1 <= renders <= 2
    assert reads[0] == renders


# ---------------------------------------------------------------- per-query views


async def test_a_views_queries_share_renders_of_their_own_one_at_a_time() -> None:
    views = SharedRenders(size=2)
    running, most, calls = 0, 0, []
    gate = asyncio.Event()

    def render_of(key: str) -> Callable[[], Awaitable[bytes]]:
        async def render() -> bytes:
            nonlocal running, most
            calls.append(key)
            running += 1
            most = max(most, running)
            await gate.wait()
            running -= 1
            return key.encode()

        return render

    asked = [asyncio.create_task(views.get(key, render_of(key))) for key in "aabba"]
    for _ in range(5):
        await asyncio.sleep(0)
    assert calls == ["a"]  # b's render waits for a's to end
    gate.set()
    assert await asyncio.gather(*asked) == [b"a", b"a", b"b", b"b", b"a"]
    # The second and fifth came during a's first render: they share its next one.
    assert calls == ["a", "b", "a", "b"] and most == 1
    # Two queries kept: asking a third forgets the one asked least recently (b).
    await views.get("c", render_of("c"))
    assert ("a" in views, "b" in views, "c" in views, len(views)) == (True, False, True, 2)


async def test_a_flood_of_a_debug_view_reads_the_pool_a_bounded_number_of_times(
    harness: Harness,
) -> None:
    engine = await harness.engine()
    node = await harness.node()
    for i in range(3):
        await node.coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url))
    reads = counted_reads(node.coordinator)

    async def view(query: str) -> list[str]:
        async with harness.http.get(node.control_url + "/debug/instance_loads" + query) as resp:
            assert resp.status == 200
            return [row["id"] for row in (await resp.json())["instances"]]

    shown = await asyncio.gather(*(view("") for _ in range(30)))
    assert all(sorted(ids) == ["e0", "e1", "e2"] for ids in shown)
    assert 1 <= reads[0] <= 2  # the first render, and one for all that came during it
    reads[0] = 0
    assert len(await view("?limit=1")) == 1  # a query of its own: its own render
    assert reads[0] == 1
