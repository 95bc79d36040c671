"""docker-compose.yml's monitoring profile: Prometheus scrapes every node, Grafana
gets the repository's dashboard and a Prometheus data source (no Docker needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "llm-load-coordinator.json"
COMPOSE = ROOT / "docker-compose.yml"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def test_compose_prometheus_scrapes_every_node_control_plane() -> None:
    services = compose()["services"]
    prometheus = services["prometheus"]
    mounted = {
        m.split(":")[1]: ROOT / m.split(":")[0].removeprefix("./") for m in prometheus["volumes"]
    }
    config = yaml.safe_load(mounted["/etc/prometheus/prometheus.yml"].read_text())
    targets = {
        t
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for t in group["targets"]
    }
    nodes = {n: s for n, s in services.items() if s.get("command", [None])[0] == "serve"}
    expected = set()
    for name, service in nodes.items():
        command = service["command"]
        expected.add(f"{name}:{command[command.index('--control-port') + 1]}")
    assert targets == expected
    assert {job.get("metrics_path", "/metrics") for job in config["scrape_configs"]} == {"/metrics"}


def test_compose_grafana_provisions_the_dashboard_and_the_datasource() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {
        m.split(":")[1]: ROOT / m.split(":")[0].removeprefix("./") for m in grafana["volumes"]
    }
    assert DASHBOARD in mounts.values()
    provisioning = mounts["/etc/grafana/provisioning"]
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())
    (provider,) = providers["providers"]
    dashboard_dir = Path(provider["options"]["path"])
    assert mounts[str(dashboard_dir / DASHBOARD.name)] == DASHBOARD
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose()["services"]
