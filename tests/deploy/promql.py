"""What the nodes export, read from their Prometheus registry, and what a PromQL
expression names (parsed with promql-parser), for the dashboard and alert checks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

promql: Any = pytest.importorskip("promql_parser", reason="the deploy extra is not installed")

# Labels Prometheus attaches to every scraped series (the Prometheus Operator adds the
# Kubernetes ones). An exported label of the same name is renamed exported_<name>.
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
)
# Series each metric type exposes (the text exposition format).
SERIES_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
# Grafana's own variables, replaced by plain values before parsing.
GRAFANA_DURATIONS = ("$__rate_interval", "$__interval", "$__range")


def exported_series(registry: Any) -> dict[str, frozenset[str]]:
    """Series name -> the label names it is queried by, for every metric in a registry."""
    labelled = {
        name: getattr(collector, "_labelnames", ())
        for name, collector in registry._names_to_collectors.items()
    }
    series: dict[str, frozenset[str]] = {}
    for family in registry.collect():
        labels = set(labelled.get(family.name, ()))
        for sample in family.samples:
            labels.update(sample.labels)
        labels.discard("le")
        renamed = {f"exported_{n}" if n in TARGET_LABELS else n for n in labels}
        for suffix in SERIES_SUFFIXES[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            series[family.name + suffix] = frozenset(renamed | extra | TARGET_LABELS)
    return series


def from_grafana(expr: str, variables: dict[str, str]) -> str:
    """A Grafana query with its variables replaced, so that it parses as PromQL."""
    for name in GRAFANA_DURATIONS:
        expr = expr.replace(name, "5m")
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"unknown variable in {expr!r}"
    return expr


@dataclass
class Names:
    """The metric names and label names one expression uses."""

    metrics: list[str] = field(default_factory=list)
    labels_by_metric: list[tuple[str, str]] = field(default_factory=list)  # (metric, label)
    grouping: list[str] = field(default_factory=list)  # by (...) / on (...) labels


def names_in(expr: str) -> Names:
    """Parse a PromQL expression; raises ValueError when it does not parse."""
    tree = promql.parse(expr)
    found = Names()

    def visit(node: Any) -> bool:
        if isinstance(node, promql.VectorSelector):
            name = node.name
            matchers = list(node.matchers.matchers)
            if name is None:  # {__name__="..."}
                name = next(m.value for m in matchers if m.name == "__name__")
            found.metrics.append(name)
            found.labels_by_metric += [(name, m.name) for m in matchers if m.name != "__name__"]
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            found.grouping += list(node.modifier.labels)
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                found.grouping += list(node.modifier.matching.labels)
        return True

    promql.walk(tree, visit)
    return found


def problems(expr: str, exported: dict[str, frozenset[str]]) -> Iterator[str]:
    """What in an expression names a metric or label the code does not export."""
    names = names_in(expr)
    if not names.metrics:
        yield f"names no metric: {expr}"
    for metric in names.metrics:
        if metric not in exported:
            yield f"unknown metric {metric}"
    for metric, label in names.labels_by_metric:
        if metric in exported and label not in exported[metric]:
            yield f"{metric} has no label {label}"
    known = set().union(*(exported.get(m, frozenset()) for m in names.metrics))
    for label in names.grouping:
        if label not in known:
            yield f"no metric of the expression has the label {label}"


def metric_name_like(text: str) -> list[str]:
    """Words in a text that look like this project's metric names (proxy_*)."""
    return re.findall(r"\bproxy_[a-z_]+\b", text)
