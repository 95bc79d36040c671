"""Prometheus metrics of one node, in a registry of its own (never the global one)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from coordinator import Coordinator
from coordinator.outliers import OutlierView
from coordinator.snapshot import Snapshot
from coordinator.strategies import Score
from coordinator.timing import relative_error

DECISION_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# |observed - predicted| / observed: 0.1 = within 10 %, 1 = off by the whole TTFT
PREDICTION_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 1, 2, 5)

# gauge name -> (help, InstanceLoad attribute)
PRESSURE_GAUGES: dict[str, tuple[str, str]] = {
    "proxy_instance_inflight": ("Live reservations on the instance", "inflight"),
    "proxy_instance_pending_prefill": (
        "Reservations waiting for their first token",
        "pending_prefill_count",
    ),
    "proxy_instance_active_decode": ("Reservations in decode", "active_decode_count"),
    "proxy_instance_predicted_backlog_ms": (
        "Predicted wait before a new prefill can start, ms",
        "predicted_total_backlog_ms",
    ),
}


class PressureCollector(Collector):
    """Per-instance pressure and coordination state, from the snapshot taken at scrape time."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.coordinator: Coordinator | None = None
        self.snapshot: Snapshot | None = None
        self.scores: Mapping[str, Score] = {}
        self.outliers: OutlierView | None = None

    def collect(self) -> Iterator[Metric]:
        """Yield the gauges of the last snapshot (nothing before the first scrape)."""
        labels = ["pool", "instance"]
        rows = self.snapshot.rows if self.snapshot is not None else []
        for name, (help_text, attr) in PRESSURE_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for row in rows:
                value = getattr(row, attr)
                if value is not None:
                    family.add_metric([self.pool, row.id], float(value))
            yield family
        alive = GaugeMetricFamily(
            "proxy_instance_alive", "1 while the instance is alive", labels=labels
        )
        score = GaugeMetricFamily(
            "proxy_instance_least_load_score",
            "least_load score of the instance (lower is chosen first)",
            labels=labels,
        )
        for row in rows:
            alive.add_metric([self.pool, row.id], 1.0 if row.alive else 0.0)
            total = self.scores[row.id].total if row.id in self.scores else None
            if total is not None:
                score.add_metric([self.pool, row.id], total)
        yield alive
        yield score
        ejected = GaugeMetricFamily(
            "proxy_instance_ejected",
            "1 while passive health keeps the instance out of selection, on every node",
            labels=labels,
        )
        failures = GaugeMetricFamily(
            "proxy_instance_consecutive_failures",
            "Failed exchanges in a row with the instance, counted by every node",
            labels=labels,
        )
        view = self.outliers
        for row in rows:
            state = view.state(row.id) if view is not None else None
            now = view.now_ms if view is not None else 0
            ejected.add_metric([self.pool, row.id], 1.0 if state and state.ejected(now) else 0.0)
            failures.add_metric(
                [self.pool, row.id], float(state.consecutive_failures) if state else 0.0
            )
        yield ejected
        yield failures
        cordoned = GaugeMetricFamily(
            "proxy_instances_cordoned",
            "Instances an operator took out of rotation (coordinator cordon), on every node",
            labels=["pool"],
        )
        cordoned.add_metric([self.pool], float(len(view.cordoned_ids()) if view is not None else 0))
        yield cordoned
        if self.coordinator is None:
            return
        degraded = GaugeMetricFamily(
            "proxy_coordination_degraded",
            "1 while Redis is unreachable and the node runs on local state",
            labels=["pool"],
        )
        degraded.add_metric(
            [self.pool], 1.0 if self.coordinator.coordination == "degraded" else 0.0
        )
        yield degraded
        stats = self.coordinator.stats
        reaped = CounterMetricFamily(
            "proxy_reservations_reaped",
            "Reservations of expired nodes this node released",
            labels=["pool"],
        )
        reaped.add_metric([self.pool], float(stats.reaped))
        yield reaped
        entries = CounterMetricFamily(
            "proxy_coordination_degraded_entries",
            "Times this node lost Redis and went degraded",
            labels=["pool"],
        )
        entries.add_metric([self.pool], float(stats.degraded_entries))
        yield entries
        for name, help_text, value in (
            (
                "proxy_coordination_lease_losses",
                "Times this node found its lease expired or gone (stall) and re-asserted",
                stats.lease_losses,
            ),
            (
                "proxy_coordination_pool_losses",
                "Times Redis lost the pool (run_id changed: FLUSHDB, eviction, empty failover)",
                stats.pool_losses,
            ),
            (
                "proxy_coordination_server_changes",
                "Calls that reached another Redis server process than the last (a restart "
                "or failover the client followed silently): re-asserted",
                stats.server_changes,
            ),
            (
                "proxy_coordination_audit_resets",
                "Times this node's audit found the pool's keys disagreeing (a key evicted or "
                "edited by hand) and cleared the pool for every node to re-assert",
                stats.audit_resets,
            ),
            (
                "proxy_coordination_orphans_released",
                "Reservations this node's audit released because their node held no lease "
                "(a rids set or the nodes key lost or edited before the reaper came)",
                stats.orphans_released,
            ),
            (
                "proxy_coordination_write_refusals",
                "Redis replies refusing a write (OOM, READONLY, MISCONF, NOREPLICAS)",
                stats.write_refusals,
            ),
            (
                "proxy_coordination_node_id_conflicts",
                "Lease renewals that found another process had renewed this node id's lease "
                "(two processes share the id: give each node its own)",
                stats.node_id_conflicts,
            ),
            (
                "proxy_coordination_unrestorable",
                "Reservations a re-assert could not restore (served, left uncounted)",
                stats.unrestorable,
            ),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["pool"])
            counter.add_metric([self.pool], float(value))
            yield counter
        retries = CounterMetricFamily(
            "proxy_reserve_retries",
            "Reserve attempts whose candidates had all changed (re-scored)",
            labels=["pool"],
        )
        retries.add_metric([self.pool], float(stats.reserve_retries))
        yield retries


class NodeMetrics:
    """The metrics of one node; `render()` gives the exposition text."""

    def __init__(self, node_id: str, pool: str, version: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "proxy_requests", "Service-plane requests by status", ["endpoint", "status"], registry=r
        )
        self.outcomes = Counter(
            "proxy_request_outcomes",
            "How proxied requests ended (completed, client_disconnect, upstream_error, ...)",
            ["outcome"],
            registry=r,
        )
        self.decisions = Histogram(
            "proxy_decision_seconds",
            "Time of one reserve call (snapshot + score + reserve)",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "proxy_ttft_seconds",
            "Time to first response byte as the proxy observes it (2xx only)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "proxy_ttft_prediction_relative_error",
            "Relative error of the predicted TTFT: |observed - predicted| / max(observed, 1 ms)",
            ["instance"],
            buckets=PREDICTION_ERROR_BUCKETS,
            registry=r,
        )
        self.connect_retries = Counter(
            "proxy_upstream_connect_retries",
            "Requests retried on another instance after a failure that reached no client byte (an engine 5xx, 429 or 408, refused, connect or first-byte timeout, empty answer)",
            registry=r,
        )
        self.accept_errors = Counter(
            "proxy_accept_errors",
            "Failed accept() calls for lack of file descriptors or memory (EMFILE, ENFILE, ...)",
            registry=r,
        )
        self.refused_connections = Counter(
            "proxy_refused_connections",
            "Client connections refused with 503 because --max-connections were open",
            registry=r,
        )
        self.malformed_requests = Counter(
            "proxy_malformed_requests",
            "Requests the HTTP parser refused (answered 400 JSON)",
            registry=r,
        )
        self.upstream_timeouts = Counter(
            "proxy_upstream_timeouts",
            "Engine exchanges ended by a timeout, by phase (connect, first_byte, idle)",
            ["phase"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "proxy_upstream_failures",
            "Failed engine exchanges counted for outlier ejection, by reason",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            "proxy_ejections",
            "Instances this node's reports ejected (fleet-wide, see proxy_instance_ejected)",
            registry=r,
        )
        self.info = Info("proxy_node", "Identity of this proxy node", registry=r)
        self.info.info({"node_id": node_id, "pool": pool, "version": version})
        self.pressure = PressureCollector(pool)
        r.register(self.pressure)

    def observe_prediction_error(
        self, instance: str, predicted_ms: float, observed_ms: float
    ) -> None:
        """Record how far one reservation's predicted TTFT was from the observed one."""
        if observed_ms <= 0:
            return  # no relative error of an instant answer
        self.ttft_prediction_error.labels(instance).observe(
            relative_error(observed_ms, predicted_ms)
        )

    def bind(self, coordinator: Coordinator) -> None:
        """Read coordination state and stats from this coordinator at scrape time."""
        self.pressure.coordinator = coordinator

    def observe_snapshot(
        self,
        snapshot: Snapshot,
        scores: Mapping[str, Score],
        outliers: OutlierView | None = None,
    ) -> None:
        """Refresh the pressure and ejection gauges (call right before render)."""
        self.pressure.snapshot = snapshot
        self.pressure.scores = scores
        self.pressure.outliers = outliers

    def render(self) -> bytes:
        """The text exposition of every metric of this node."""
        return generate_latest(self.registry)
