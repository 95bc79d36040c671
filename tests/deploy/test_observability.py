"""The Grafana dashboard and the chart's alert rules name only metrics (and labels)
that the nodes export: read from a node's own Prometheus registry, never from a
hand-written list."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from coordinator import Coordinator
from coordinator.strategies import eligible, score_rows
from proxy_node.metrics import NodeMetrics
from tests.deploy.chart import CHART, ROOT, VALUES_FILES, one, render_file
from tests.deploy.promql import exported_series, from_grafana, names_in, problems
from tests.helpers import spec

DASHBOARD = ROOT / "deploy" / "grafana" / "llm-load-coordinator.json"


@pytest.fixture
async def exported() -> AsyncIterator[dict[str, frozenset[str]]]:
    """Every series a node exports, with its labels, after one scrape of a live pool."""
    import fakeredis

    coordinator = Coordinator(fakeredis.FakeAsyncRedis(decode_responses=True), pool="metrics")
    try:
        await coordinator.register_instance(spec(0))
        snap = await coordinator.snapshot()
        metrics = NodeMetrics(coordinator.node_id, coordinator.pool, "test")
        metrics.bind(coordinator)
        metrics.observe_snapshot(
            snap, score_rows(eligible(snap.rows), coordinator.settings.weights)
        )
        yield exported_series(metrics.registry)
    finally:
        await coordinator.close()


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana variables replaced."""
    variables = {v["name"]: "x" for v in dashboard()["templating"]["list"]}
    queries = [
        (panel["title"], from_grafana(target["expr"], variables))
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(selector, label) asks for the label's values on a series.
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, variable
            selector, label = match.groups()
            queries.append((f"variable {variable['name']}", f"group by ({label}) ({selector})"))
    return queries


def rule_expressions() -> list[tuple[str, str]]:
    objects = render_file(next(p for p in VALUES_FILES if "autoscaling" in p.name))
    rule = one(objects, "PrometheusRule")
    return [(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def test_the_exported_series_come_from_the_registry(exported: dict[str, frozenset[str]]) -> None:
    # A sample of what the registry must yield, so that an empty read cannot pass.
    assert "proxy_ttft_seconds_bucket" in exported
    assert "exported_instance" in exported["proxy_instance_inflight"]
    assert "proxy_reservations_reaped_total" in exported
    assert "proxy_no_such_metric" not in exported


def test_dashboard_queries_name_only_exported_metrics_and_labels(
    exported: dict[str, frozenset[str]],
) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    found = {f"{title}: {p}" for title, expr in queries for p in problems(expr, exported)}
    assert not found, sorted(found)


def test_the_dashboard_covers_the_issue_panels(exported: dict[str, frozenset[str]]) -> None:
    used = {m for _, expr in dashboard_queries() for m in names_in(expr).metrics}
    for metric in (
        "proxy_instance_inflight",  # per-instance pressure
        "proxy_instance_predicted_backlog_ms",
        "proxy_ttft_seconds_bucket",  # TTFT
        "proxy_ttft_prediction_relative_error_bucket",  # prediction error
        "proxy_decision_seconds_count",  # decisions per second
        "proxy_decision_seconds_bucket",  # decision latency
        "proxy_coordination_degraded",  # degraded time
        "proxy_reservations_reaped_total",  # reaps
        "proxy_instances_cordoned",  # an operator's drains
    ):
        assert metric in used and metric in exported, metric


def test_a_wrong_name_or_label_is_reported(exported: dict[str, frozenset[str]]) -> None:
    """The checks above can fail: a renamed metric or a collided label is caught."""
    assert list(problems("rate(proxy_ttft_seconds_total[5m])", exported)) == [
        "unknown metric proxy_ttft_seconds_total"
    ]
    # Prometheus keeps `instance` for the target: the engine id is exported_instance.
    assert list(problems('sum by (engine) (proxy_instance_inflight{pool="a"})', exported)) == [
        "no metric of the expression has the label engine"
    ]
    assert list(problems('proxy_requests_total{pool="a"}', exported)) == [
        "proxy_requests_total has no label pool"
    ]


def test_dashboard_structure() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource, panel["title"]
        assert all(t["datasource"] == datasource for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "job"]


def test_alert_rules_name_only_exported_metrics_and_labels(
    exported: dict[str, frozenset[str]],
) -> None:
    rules = rule_expressions()
    # The alerts the issue asks for: node degraded, instances ejected, pool full,
    # prediction error high.
    assert {
        "LLMCoordinatorNodeDegraded",
        "LLMCoordinatorInstanceEjected",
        "LLMCoordinatorPoolFull",
        "LLMCoordinatorPredictionErrorHigh",
    } <= {a for a, _ in rules}
    found = {f"{alert}: {p}" for alert, expr in rules for p in problems(expr, exported)}
    assert not found, sorted(found)


def test_outcome_values_in_alert_rules_are_ones_the_node_sets() -> None:
    source = (ROOT / "proxy_node" / "forwarding.py").read_text()
    values = {
        value for _, expr in rule_expressions() for value in re.findall(r'outcome="([^"]+)"', expr)
    }
    assert values, "no rule filters on an outcome"
    for value in values:
        assert f'"{value}"' in source, f"no request ends with outcome {value!r}"


def test_the_documented_adapter_rule_names_exported_metrics(
    exported: dict[str, frozenset[str]],
) -> None:
    """docs/deploy.md's prometheus-adapter rule, with the adapter's template filled in."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", doc, re.S) if "metricsQuery" in b]
    (rule,) = yaml.safe_load(block)["rules"]["external"]
    series = rule["seriesQuery"]
    assert not list(problems(series, exported)), series
    metric = names_in(series).metrics[0]
    query = rule["metricsQuery"].replace("<<.Series>>", metric)
    query = query.replace("<<.LabelMatchers>>", 'namespace="inference",pool="chat"')
    assert not list(problems(query, exported)), query
    # The HPA selects the adapter's metric by pool, and divides it by the node count.
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert rule["name"]["as"] == defaults["autoscaling"]["inflightPerNode"]["metricName"]
    assert "pool" in names_in(query).grouping
