"""Render the Helm chart offline (helm-python-sdk) and pick objects out of the result."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "llm-load-coordinator"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "llc"
NAMESPACE = "inference"
# The oldest and the newest Kubernetes minor releases still supported upstream.
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
# Prometheus Operator kinds: kubernetes-validate has no schema for them, so their
# tests check them against the chart's own objects and the code instead.
OPERATOR_KINDS = frozenset({"ServiceMonitor", "PrometheusRule"})

Obj = dict[str, Any]

helm: Any = pytest.importorskip("helm_python", reason="the deploy extra is not installed")


def values_of(path: Path) -> dict[str, Any]:
    """A values file as a dict."""
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), path
    return loaded


def render(values: Mapping[str, Any] | None = None) -> list[Obj]:
    """Every object the chart renders with these values (as `helm install` would)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests: dict[str, str] = chart.render(
            dict(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    objects: list[Obj] = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def notes(values: Mapping[str, Any] | None = None) -> str:
    """The NOTES.txt `helm install` prints."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests: dict[str, str] = chart.render(
            dict(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def render_file(path: Path) -> list[Obj]:
    """Render with one of the chart's ci/ values files."""
    return render(values_of(path))


def one(objects: list[Obj], kind: str, name_suffix: str = "") -> Obj:
    """The single object of this kind (whose name ends with name_suffix)."""
    found = [
        o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)
    ]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def node_deployment(objects: list[Obj]) -> Obj:
    """The proxy nodes' Deployment."""
    found = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "proxy-node"
    ]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    return found[0]


def node_container(objects: list[Obj]) -> Obj:
    """The proxy node container."""
    containers = node_deployment(objects)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: Obj = containers[0]
    return container


def expansions(text: str) -> list[str]:
    """The $(NAME) references Kubernetes expands in an env value or an argument."""
    return re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text)


def env_values(container: Obj, secrets: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the process would see it.

    Secret references are resolved from `secrets` ((name, key) -> value), the pod name
    is `<release>-node-0`, and $(NAME) references are expanded like the kubelet does.
    """
    resolved: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            value = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: resolved.get(m.group(1), m.group(0)),
                str(entry["value"]),
            )
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            value = secrets[(ref["name"], ref["key"])]
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            value = f"{RELEASE}-node-0"
        else:
            raise AssertionError(f"unexpected env source: {entry}")
        resolved[name] = value
    return resolved


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a nested structure of dicts and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key), value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)
