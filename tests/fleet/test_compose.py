"""docker-compose.yml, checked without a Docker engine: commands, ports, variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy_node import state
from proxy_node.config import NodeConfig
from tests.cross_check import known_environment, parse_command

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
PROJECT_SERVICES = {
    name: s for name, s in SERVICES.items() if s.get("image", "").startswith("llm-load-coordinator")
}


@pytest.mark.parametrize("name", sorted(PROJECT_SERVICES))
def test_every_command_is_a_real_entry_point_with_valid_flags(name: str) -> None:
    command = PROJECT_SERVICES[name]["command"]
    assert isinstance(command, list) and command, name
    args = parse_command(command)
    assert args.command == command[0]


def test_ports_do_not_clash() -> None:
    published = [
        int(str(mapping).split(":")[0])
        for service in SERVICES.values()
        for mapping in service.get("ports", [])
    ]
    assert published, "the compose file publishes no port"
    assert len(published) == len(set(published)), sorted(published)


@pytest.mark.parametrize("name", sorted(PROJECT_SERVICES))
def test_environment_names_are_read_by_the_code(name: str) -> None:
    environment = PROJECT_SERVICES[name].get("environment", {})
    unknown = set(environment) - known_environment()
    assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"


def test_topology_matches_the_local_cluster() -> None:
    nodes = [n for n, s in SERVICES.items() if s.get("command", [None])[0] == "serve"]
    engines = [n for n, s in SERVICES.items() if s.get("command", [None])[0] == "mock-engine"]
    assert len(nodes) == 3 and len(engines) == 4
    assert "healthcheck" in SERVICES["redis"]
    for name in nodes:
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    firsts = set()
    for name in engines:
        command = SERVICES[name]["command"]
        targets = command[command.index("--register") + 1].split(",")
        # Every node's control plane, so a stopped node leaves its engines registered;
        # the first ones spread the engines over the nodes.
        assert sorted(targets) == sorted(f"http://{node}:8002" for node in nodes), targets
        firsts.add(targets[0])
        assert SERVICES[name]["depends_on"], name
    assert len(firsts) == len(nodes)
    # Every node gets its Redis and pool from the environment it declares.
    for name in nodes:
        env = SERVICES[name]["environment"]
        assert env["COORD_REDIS_URL"].startswith("redis://redis:")
        assert env["COORD_POOL"]


def test_nodes_get_the_time_to_drain_before_a_kill() -> None:
    nodes = [s for s in SERVICES.values() if s.get("command", [None])[0] == "serve"]
    assert nodes
    for service in nodes:
        env = {k: str(v) for k, v in service["environment"].items()}
        config = NodeConfig.from_env(env)
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and grace[:-1].isdigit(), grace
        budget = config.drain_delay_s + config.drain_timeout_s + state.DRAIN_TIMEOUT_S
        assert int(grace[:-1]) > budget


def test_dockerfile_installs_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install" in text and 'ENTRYPOINT ["coordinator"]' in text
