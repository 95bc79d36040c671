"""The Helm chart, rendered offline with every ci/ values file and checked against
the Kubernetes schemas and against the code it configures (flags, environment,
routes, drain timing)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from coordinator.connection import _split_multi
from coordinator.keys import POOL_NAME_RE
from coordinator.settings import STRATEGIES, Settings
from proxy_node import serve, state
from proxy_node.app import create_app, create_control_app
from proxy_node.config import NodeConfig
from proxy_node.entry import LOG_LEVELS
from tests.cross_check import NODE_HOMES, environment_read_by, parse_command
from tests.deploy.chart import (
    CHART,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    OPERATOR_KINDS,
    VALUES_FILES,
    Obj,
    env_values,
    expansions,
    helm,
    node_container,
    node_deployment,
    notes,
    one,
    render,
    render_file,
    values_of,
    walk,
)

kubernetes_validate: Any = pytest.importorskip("kubernetes_validate")

FILES = pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
SECRET_URL = "rediss://coordinator:url-s3cr3t@redis.example.com:6380/1"


def test_the_ci_values_files_cover_every_redis_mode_and_autoscaling() -> None:
    modes = {values_of(p).get("redis", {}).get("mode", "single") for p in VALUES_FILES}
    assert modes == {"single", "sentinel", "cluster"}
    assert any(values_of(p).get("autoscaling", {}).get("enabled") for p in VALUES_FILES)
    assert any(p.name == "minimal-values.yaml" for p in VALUES_FILES)


@FILES
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    values_file: Path, version: str
) -> None:
    objects = render_file(values_file)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            continue  # no schema in kubernetes-validate: see the operator tests below
        # strict: an unknown field (a typo in a template) is an error too.
        kubernetes_validate.validate(obj, version, strict=True)


@FILES
def test_helm_lint_is_clean(values_file: Path) -> None:
    report = helm.lint(
        str(CHART),
        values_of(values_file),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBERNETES_VERSIONS[0]}",
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 = warning


def test_values_schema_agrees_with_the_code() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    node = schema["properties"]["node"]["properties"]
    assert tuple(node["strategy"]["enum"]) == STRATEGIES
    assert tuple(node["logLevel"]["enum"]) == LOG_LEVELS
    # JSON Schema regexes are ECMA-262: `$` ends the string (no trailing newline), as \Z does.
    assert node["pool"]["pattern"] == "^" + POOL_NAME_RE.pattern.removesuffix(r"\Z") + "$"


@pytest.mark.parametrize(
    "values",
    [{"replicas": 3}, {"redis": {"mode": "sentinal"}}, {"node": {"strategy": "fastest"}}],
    ids=["typo", "bad-mode", "bad-strategy"],
)
def test_values_outside_the_schema_are_refused(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"redis": {"host": "r"}} | values)


def test_a_broken_object_fails_the_validation() -> None:
    """The validation above can fail: a misplaced field is caught."""
    deployment = node_deployment(render({"redis": {"host": "redis"}}))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_only_the_known_operator_kinds_are_unvalidated() -> None:
    objects = render_file(next(p for p in VALUES_FILES if "autoscaling" in p.name))
    unknown = {o["kind"] for o in objects} & OPERATOR_KINDS
    assert unknown == OPERATOR_KINDS  # both rendered, so their own tests see them
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"


# ------------------------------------------------------------ flags and environment


def _fake_secrets(container: Obj) -> dict[tuple[str, str], str]:
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    return {
        (r["name"], r["key"]): SECRET_URL if "url" in r["key"] else f"s3cr3t-{r['key']}"
        for r in refs
    }


def _node_config(container: Obj, monkeypatch: pytest.MonkeyPatch) -> NodeConfig:
    """The NodeConfig a node builds from the container's command line and environment."""
    args = parse_command(container["args"])  # SystemExit on a flag the CLI lacks
    assert args.command == "serve"
    for name in environment_read_by(NODE_HOMES):
        monkeypatch.delenv(name, raising=False)
    for name, value in env_values(container, _fake_secrets(container)).items():
        monkeypatch.setenv(name, value)
    return serve.config_from_args(args)


@FILES
def test_command_line_is_one_the_cli_parses(values_file: Path) -> None:
    container = node_container(render_file(values_file))
    assert "command" not in container  # the image's ENTRYPOINT is the CLI
    args = parse_command(container["args"])
    assert isinstance(args, argparse.Namespace) and args.command == "serve"


@FILES
def test_environment_names_are_read_by_the_node(values_file: Path) -> None:
    container = node_container(render_file(values_file))
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), names
    # A variable only Kubernetes reads (expanded into another value) must be used.
    expanded = {n for e in container["env"] for n in expansions(str(e.get("value", "")))}
    assert expanded <= set(names)
    unknown = set(names) - environment_read_by(NODE_HOMES) - expanded
    assert not unknown, f"the chart sets variables no node code reads: {sorted(unknown)}"


def test_an_unknown_variable_is_caught() -> None:
    """The check above can fail: a knob that does not exist is reported."""
    values = {"redis": {"host": "r"}, "node": {"settings": {"no_such_knob": 1}}}
    container = node_container(render(values))
    names = {e["name"] for e in container["env"]}
    assert "COORD_NO_SUCH_KNOB" in names - environment_read_by(NODE_HOMES)


@FILES
def test_the_node_accepts_the_rendered_configuration(
    values_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = values_of(values_file)
    objects = render(values)
    container = node_container(objects)
    config = _node_config(container, monkeypatch)
    node = values.get("node", {})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (config.host, config.port, config.control_port) == (
        "0.0.0.0",
        ports["http"],
        ports["control"],
    )
    assert config.bind_control == "0.0.0.0"  # the control Service reaches it
    assert config.pool == node.get("pool", "default")
    assert config.strategy == node.get("strategy", "least_load")
    assert list(config.instances) == node.get("instances", [])
    assert config.node_id == "llc-node-0"
    token_key = values.get("auth", {}).get("tokenKey", "token")
    assert config.token == f"s3cr3t-{token_key}"
    expected = Settings.from_env(
        {f"COORD_{k.upper()}": str(v) for k, v in node.get("settings", {}).items()}
    )
    for knob in node.get("settings", {}):
        assert getattr(config.settings, knob) == getattr(expected, knob), knob


@FILES
def test_the_redis_url_names_the_configured_servers(
    values_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = values_of(values_file)
    redis = values.get("redis", {})
    config = _node_config(node_container(render(values)), monkeypatch)
    url = config.redis_url
    password = f"s3cr3t-{redis.get('passwordKey', 'redis-password')}"
    if redis.get("urlSecret", {}).get("name"):
        assert url == SECRET_URL
        return
    mode = redis.get("mode", "single")
    if mode == "single":
        if values.get("bundledRedis", {}).get("enabled"):
            assert url == f"redis://:{password}@llc-llm-load-coordinator-redis:6379/0"
        else:
            assert url == f"redis://{redis['host']}:6379/0"
        return
    user, secret, hosts, path = _split_multi(url)  # what connect_redis parses
    assert (user, secret) == (redis.get("username") or None, password)
    servers = redis[mode]["hosts"]
    assert [f"{h}:{p}" for h, p in hosts] == servers
    if mode == "sentinel":
        assert url.startswith("redis+sentinel://")
        assert path == f"{redis['sentinel']['masterName']}/{redis.get('db', 0)}"
    else:
        assert url.startswith("redis+cluster://") and path == ""


@pytest.mark.parametrize(
    "redis",
    [
        {"mode": "single"},
        {"mode": "sentinel"},
        {"mode": "cluster"},
        {"mode": "replicated", "host": "r"},
    ],
    ids=["single-without-host", "sentinel-without-hosts", "cluster-without-hosts", "bad-mode"],
)
def test_incomplete_redis_values_fail_to_render(redis: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError, match="redis"):
        render({"redis": redis})


# ------------------------------------------------------------ secrets


@FILES
def test_secrets_never_appear_in_plain_text(values_file: Path) -> None:
    values = values_of(values_file)
    for key, value in walk(values):
        if any(word in key.lower() for word in ("password", "token")) and not key.endswith("Key"):
            raise AssertionError(f"{values_file.name}: {key}={value!r} in a values file")
    container = node_container(render(values))
    for entry in container["env"]:
        if any(word in entry["name"] for word in ("TOKEN", "PASSWORD")):
            assert "secretKeyRef" in entry.get("valueFrom", {}), entry
        if entry["name"] == "COORD_REDIS_URL" and "@" in entry.get("value", ""):
            userinfo = entry["value"].split("://", 1)[1].split("@")[0]
            assert ":" not in userinfo or userinfo.endswith(":$(REDIS_PASSWORD)"), entry


def test_a_generated_token_is_random_and_an_existing_secret_is_used_as_is() -> None:
    def tokens(values: dict[str, Any]) -> list[str]:
        return [
            o["data"]["token"]
            for o in render(values)
            if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-token")
        ]

    first, second = tokens({"redis": {"host": "r"}}), tokens({"redis": {"host": "r"}})
    assert len(first) == len(second) == 1 and first != second
    assert tokens({"redis": {"host": "r"}, "auth": {"existingSecret": "mine"}}) == []


# ------------------------------------------------------------ wiring between objects


@FILES
def test_services_pdb_and_hpa_select_the_node_pods(values_file: Path) -> None:
    objects = render_file(values_file)
    deployment = node_deployment(objects)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = node_container(objects)
    port_names = {p["name"] for p in container["ports"]}
    for suffix, port in (("coordinator", "http"), ("-control", "control")):
        service = one(objects, "Service", suffix)
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert [p["targetPort"] for p in service["spec"]["ports"]] == [port]
        assert port in port_names
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    if values_of(values_file).get("autoscaling", {}).get("enabled"):
        (hpa,) = hpas
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"]  # the HPA owns the count
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        external = [m for m in hpa["spec"]["metrics"] if m["type"] == "External"]
        pool = values_of(values_file).get("node", {}).get("pool", "default")
        assert [m["external"]["metric"]["selector"]["matchLabels"] for m in external] == [
            {"pool": pool}
        ]
    else:
        assert hpas == [] and deployment["spec"]["replicas"] >= 1


def test_bundled_redis_is_off_by_default_and_reachable_when_on() -> None:
    assert not any("redis" in o["metadata"]["name"] for o in render({"redis": {"host": "r"}}))
    objects = render({"bundledRedis": {"enabled": True}})
    service = one(objects, "Service", "-redis")
    redis = one(objects, "Deployment", "-redis")
    assert (
        service["spec"]["selector"].items()
        <= redis["spec"]["template"]["metadata"]["labels"].items()
    )
    # The nodes' password and the server's come from the same Secret key.
    server_env = redis["spec"]["template"]["spec"]["containers"][0]["env"]
    node_env = node_container(objects)["env"]
    ref = [e["valueFrom"]["secretKeyRef"] for e in server_env if e["name"] == "REDIS_PASSWORD"]
    assert ref == [
        e["valueFrom"]["secretKeyRef"] for e in node_env if e["name"] == "REDIS_PASSWORD"
    ]
    assert one(objects, "Secret", "-redis")["metadata"]["name"] == ref[0]["name"]


def test_min_replicas_above_max_fails_to_render() -> None:
    with pytest.raises(helm.HelmError, match="minReplicas"):
        render(
            {
                "redis": {"host": "r"},
                "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
            }
        )


def test_the_install_notes_name_real_services_and_routes() -> None:
    values = {"bundledRedis": {"enabled": True}}
    objects = render(values)
    text = notes(values)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    service_app = create_app(NodeConfig())
    routes = {"8001": _routes(service_app), "8002": _routes(create_control_app(service_app))}
    urls = re.findall(r"http://([\w.-]+):(\d+)(/[\w/]*)", text)
    assert len(urls) == 3, text
    for host, port, path in urls:
        if host != "127.0.0.1":  # <service>.<namespace>.svc
            name, namespace, _ = host.split(".")
            assert namespace == NAMESPACE and name in services, host
            assert [p["port"] for p in services[name]["spec"]["ports"]] == [int(port)]
        assert path in routes[port], (port, path)
    assert "bundled Redis" in text


# ------------------------------------------------------------ probes and drain


def _routes(app: Any) -> set[str]:
    return {r.canonical for r in app.router.resources()}


@FILES
def test_probes_call_routes_the_node_serves_on_those_ports(values_file: Path) -> None:
    container = node_container(render_file(values_file))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = create_app(NodeConfig())  # built, never started: no Redis needed
    planes = {"http": _routes(service), "control": _routes(create_control_app(service))}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        if "httpGet" in spec:
            get = spec["httpGet"]
            assert get["path"] in planes[get["port"]], (probe, get)
        else:
            command = " ".join(spec["exec"]["command"])
            assert f"http://127.0.0.1:{ports['http']}/healthz" in command
            assert "/healthz" in planes["http"]
    # Liveness must not ride on the service plane, which may be saturated.
    assert container["livenessProbe"]["httpGet"]["port"] == "control"


@FILES
def test_the_drain_the_chart_configures_is_the_one_the_node_runs(
    values_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = values_of(values_file)
    objects = render(values)
    container = node_container(objects)
    pod = node_deployment(objects)["spec"]["template"]["spec"]
    defaults = values_of(CHART / "values.yaml")["drain"]
    drain = defaults | values.get("drain", {})
    config = _node_config(container, monkeypatch)
    assert (config.drain_delay_s, config.drain_timeout_s) == (
        drain["delaySeconds"],
        drain["timeoutSeconds"],
    )
    # The kubelet kills at the grace period, counted from the preStop hook's start:
    # the drain delay, the in-flight drain, then the last releases (NodeState.drain).
    budget = config.drain_delay_s + config.drain_timeout_s + state.DRAIN_TIMEOUT_S
    assert pod["terminationGracePeriodSeconds"] > budget
    # A draining node fails /healthz on both planes and then closes them: liveness
    # must not restart it before the grace period ends.
    liveness = container["livenessProbe"]
    assert (
        liveness["periodSeconds"] * liveness["failureThreshold"]
        >= pod["terminationGracePeriodSeconds"]
    )


def test_the_pre_stop_hook_signals_the_node_process() -> None:
    """The hook sends SIGTERM to PID 1, which is the node only in the chart's setup."""
    objects = render({"redis": {"host": "r"}})
    container = node_container(objects)
    pod = node_deployment(objects)["spec"]["template"]["spec"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "/bin/sh",
        "-c",
        "kill -TERM 1",
    ]
    assert "command" not in container and not pod.get("shareProcessNamespace")
    # An exec-form ENTRYPOINT: the CLI itself is PID 1, not a shell in front of it.
    dockerfile = (CHART.parents[2] / "Dockerfile").read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", dockerfile, re.M)
    assert json.loads(entrypoint) == ["coordinator"]


# ------------------------------------------------------------ Prometheus Operator objects


def test_service_monitor_scrapes_the_control_plane_metrics() -> None:
    objects = render_file(next(p for p in VALUES_FILES if "autoscaling" in p.name))
    monitor = one(objects, "ServiceMonitor")
    control = one(objects, "Service", "-control")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= control["metadata"]["labels"].items()
    # Only the control Service matches: the service plane would double every series.
    service = one(objects, "Service", "coordinator")
    assert not selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in control["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    service_app = create_app(NodeConfig())
    assert "/metrics" in _routes(create_control_app(service_app))
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rules_are_well_formed() -> None:
    objects = render_file(next(p for p in VALUES_FILES if "autoscaling" in p.name))
    rule = one(objects, "PrometheusRule")
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) and names
    for r in rules:
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r
        assert r["annotations"]["summary"], r
        assert f'namespace="{NAMESPACE}"' in r["expr"], r  # scoped to this release


@pytest.mark.parametrize(
    ("drain", "probes", "complaint"),
    [
        # Streams of up to 2 minutes, default liveness (60 s): restarted mid-drain.
        ({"timeoutSeconds": 120}, {}, "liveness"),
        ({}, {"liveness": {"periodSeconds": 5, "failureThreshold": 3}}, "liveness"),
        # No time left for the last releases (NodeState.drain) before the kill.
        ({"slackSeconds": int(state.DRAIN_TIMEOUT_S)}, {}, "slackSeconds"),
    ],
)
def test_a_drain_the_pod_would_not_survive_fails_to_render(
    drain: dict[str, Any], probes: dict[str, Any], complaint: str
) -> None:
    values = {"redis": {"host": "r"}, "drain": drain, "probes": probes}
    with pytest.raises(helm.HelmError, match=complaint):
        render(values)
