"""The runtime's Prometheus metrics, in a registry the owner passes (no process-global state).

Every outcome of the reconcile loop is counted with the pool as a label; a pool's metrics exist
from the moment the runtime knows the pool, so a dashboard sees zeros rather than gaps.
"""

from __future__ import annotations

from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CrashReason = Literal["failed_to_start", "exited", "start_timeout", "spawn_failed", "preempted"]
CRASH_REASONS: Final[tuple[CrashReason, ...]] = (
    "failed_to_start",  # exited before it answered /health
    "exited",  # exited while ready or draining
    "start_timeout",  # killed: not ready within ready_timeout_s
    "spawn_failed",  # the command could not be executed at all
    "preempted",  # killed at a preemption notice's deadline: its GPUs were taken back
)
DRAIN_OUTCOMES: Final = ("drained", "drain_timeout")
STOP_SIGNALS: Final = ("term", "kill")

START_BUCKETS: Final = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds from launch to ready: a sim engine takes about 1 s, vLLM with a 70B model minutes."""


class RuntimeMetrics:
    """Counters, gauges and the start-latency histogram of one runtime."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.starts = Counter(
            "gpufleet:runtime_replica_starts",
            "Replica processes launched (first starts and restarts).",
            ["pool"],
            registry=registry,
        )
        self.restarts = Counter(
            "gpufleet:runtime_replica_restarts",
            "Replica processes launched again after a crash.",
            ["pool"],
            registry=registry,
        )
        self.crashes = Counter(
            "gpufleet:runtime_replica_crashes",
            "Replica processes that failed, by reason.",
            ["pool", "reason"],
            registry=registry,
        )
        self.drains = Counter(
            "gpufleet:runtime_replica_drains",
            "Drains ended: in-flight work finished (drained) or the deadline passed.",
            ["pool", "outcome"],
            registry=registry,
        )
        self.stops = Counter(
            "gpufleet:runtime_replica_stops",
            "Stopped replica processes, by the signal that ended them.",
            ["pool", "signal"],
            registry=registry,
        )
        self.ready = Gauge(
            "gpufleet:runtime_ready_replicas",
            "Replicas ready to serve.",
            ["pool"],
            registry=registry,
        )
        self.desired = Gauge(
            "gpufleet:runtime_desired_replicas",
            "Replicas wanted.",
            ["pool"],
            registry=registry,
        )
        self.standby = Gauge(
            "gpufleet:runtime_standby_replicas",
            "Prewarmed standbys ready to be promoted.",
            ["pool"],
            registry=registry,
        )
        self.promotions = Counter(
            "gpufleet:runtime_promotions",
            "Standbys promoted into service.",
            ["pool"],
            registry=registry,
        )
        self.start_seconds = Histogram(
            "gpufleet:runtime_replica_start_seconds",
            "Seconds from launching a replica to its first healthy answer.",
            ["pool"],
            buckets=START_BUCKETS,
            registry=registry,
        )

    def add_pool(self, pool: str) -> None:
        """Create every labelled child of ``pool`` at zero."""
        self.starts.labels(pool)
        self.restarts.labels(pool)
        for reason in CRASH_REASONS:
            self.crashes.labels(pool, reason)
        for outcome in DRAIN_OUTCOMES:
            self.drains.labels(pool, outcome)
        for sig in STOP_SIGNALS:
            self.stops.labels(pool, sig)
        self.ready.labels(pool)
        self.desired.labels(pool)
        self.standby.labels(pool)
        self.promotions.labels(pool)
        self.start_seconds.labels(pool)
