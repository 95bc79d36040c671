"""Learned timing as a node shows it: the prediction header, /debug/instance_loads,
and the prediction-error histogram of /metrics."""

from __future__ import annotations

import re

from tests.fake_engine import Harness
from tests.service.test_proxy_forwarding import CHAT, metric, node_with, post


async def test_an_engine_without_timing_gets_predictions_and_its_sources_are_shown(
    harness: Harness,
) -> None:
    engine = await harness.engine(chunks=3)
    node = await node_with(harness, engine)
    for _ in range(3):
        resp = await post(harness, node, {**CHAT, "stream": True})
        async with resp:
            assert resp.status == 200
            predicted = resp.headers["X-Predicted-TTFT-Ms"]
            await resp.read()
        assert predicted.isdigit()
    async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
        view = await resp.json()
    timing = view["instances"][0]["timing"]
    assert (timing["prefill"], timing["decode"]) == ("default", "default")
    assert timing["prefill_ms_per_token"] == 0.08 and timing["decode_ms_per_token"] == 16.0
    assert set(timing) >= {"prefill_samples", "decode_samples", "decode_ms_per_seq"}
    count = await metric(
        harness, node.url, "proxy_ttft_prediction_relative_error_count", instance="e0"
    )
    assert count == 3
    async with harness.http.get(node.url + "/metrics") as resp:
        text = await resp.text()
    assert re.search(
        r'proxy_ttft_prediction_relative_error_bucket\{instance="e0",le="0.25"\}', text
    )


async def test_configured_timing_is_shown_as_configured(harness: Harness) -> None:
    engine = await harness.engine(chunks=2)
    node = await node_with(harness, engine, timing=True)
    await node.coordinator.sync_timing()
    async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
        view = await resp.json()
    timing = view["instances"][0]["timing"]
    assert (timing["prefill"], timing["prefill_ms_per_token"]) == ("configured", 0.1)
