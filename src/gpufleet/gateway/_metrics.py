"""The gateway's Prometheus metrics, in the registry it is given (served at ``/metrics``).

Label children are cached per model and replica, so the hot path does dictionary lookups,
not ``labels()`` calls; the metrics updated per request are ``_lean``'s (no lock per value).
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpufleet.gateway._lean import LeanCounter, LeanGauge, LeanHistogram

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class GatewayMetrics:
    """Every gateway metric (names in docs/gateway.md)."""

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the hot path's way to a labelled child. A
        replica's children leave the cache with it (:meth:`forget_replica`)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def in_flight_of(self, replica: str) -> int:
        """Attempts in flight on ``replica`` as the gauge shows them (the pool controller
        owns the count; this tells only when a departed replica's series may go)."""
        found = self._children.get((id(self.in_flight), (replica,)))
        return 0 if found is None else int(found.value)

    def forget_replica(self, replica: str) -> None:
        """A replica left the replica set: drop its series and cached children, so churn
        (unique pod names) does not grow ``/metrics`` and memory without bound. The
        in-flight gauge goes only once it reads 0 (the caller retries at the last end)."""
        if self.in_flight_of(replica) == 0:
            self.in_flight.remove_where(0, replica)
            self._children.pop((id(self.in_flight), (replica,)), None)
        self.attempts.remove_where(0, replica)
        attempts = id(self.attempts)
        for key in [k for k in self._children if k[0] == attempts and k[1][0] == replica]:
            del self._children[key]
        for gauge in (self.queue, self.kv_usage):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        p = "gpufleet:gateway_"
        self.requests = LeanCounter(
            p + "requests", "Requests answered, by model and HTTP status.",
            ["model", "status"], registry=registry,
        )  # fmt: skip
        self.ttft = LeanHistogram(
            p + "time_to_first_token_seconds",
            "Request arrival to the first body byte from the replica, as the gateway sees it.",
            ["model"], registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = LeanHistogram(
            p + "e2e_request_latency_seconds", "Request arrival to its last byte sent.",
            ["model"], registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.overhead = LeanHistogram(
            p + "overhead_seconds",
            "Gateway time before the first attempt is sent (parse, route).",
            ["model"], registry, buckets=_OVERHEAD_BUCKETS,
        )  # fmt: skip
        self.retries = Counter(
            p + "retries",
            "Attempts after a failed one: retries (the failure came before the first byte) "
            "and stream resumes (after it), by the failure's outcome.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip
        self.resumes = Counter(
            p + "stream_resumes",
            "Streams that broke after their first byte, by how it went on: resumed (sent to "
            "another replica) or broken (ended with an error event).",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip
        self.fallbacks = Counter(
            p + "fallbacks",
            "Requests sent on from a served name to the next of its fallbacks, by the name "
            "left, the name gone to and why (a reject reason of the pool left, or context).",
            ["model", "to", "reason"], registry=registry,
        )  # fmt: skip
        self.abandoned = Counter(
            p + "abandoned_attempts",
            "Attempts ended because their replica failed its health checks "
            "(health.active.abandon) or is about to be preempted (spot.abandon_before): "
            "retried or resumed elsewhere.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.recalls = Counter(
            p + "batch_recalls",
            "Batch lines whose attempt was stopped because an interactive request needed its "
            "slot (gateway.batch.spare.recall): each waits at the gate again and runs anew.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.resumed_prompt_tokens = Counter(
            p + "resumed_prompt_tokens",
            "Prompt tokens sent again by resumed streams (the prompt plus what was sent).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.retries_refused = Counter(
            p + "retry_budget_exhausted",
            "Retries not made because the retry budget was used up.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.attempts = LeanCounter(
            p + "upstream_attempts", "Attempts sent to replicas, by how they ended.",
            ["replica", "outcome"], registry=registry,
        )  # fmt: skip
        self.in_flight = LeanGauge(
            p + "in_flight_requests", "Attempts in flight per replica.",
            ["replica"], registry=registry,
        )  # fmt: skip
        self.queue = Gauge(
            p + "replica_waiting_requests", "Requests waiting in each replica (last scrape).",
            ["replica"], registry=registry,
        )  # fmt: skip
        self.kv_usage = Gauge(
            p + "replica_kv_cache_usage", "KV-cache usage of each replica (last scrape, 0-1).",
            ["replica"], registry=registry,
        )  # fmt: skip
        self.replica_state = Gauge(
            p + "replica_state", "1 for each replica's routing state.",
            ["replica", "state"], registry=registry,
        )  # fmt: skip
        self.ejections = Counter(
            p + "ejections", "Outlier ejections (enforced or dry-run, overflow refused).",
            ["model", "cause", "enforced"], registry=registry,
        )  # fmt: skip
        self.routing = LeanCounter(
            p + "routing_decisions", "Routing decisions, by policy and whether in panic.",
            ["model", "policy", "panic"], registry=registry,
        )  # fmt: skip
        self.prefix_match = LeanHistogram(
            p + "prefix_match_blocks",
            "Prefix blocks of a request the chosen replica was believed to hold.",
            ["model"], registry, buckets=_BLOCK_BUCKETS,
        )  # fmt: skip
        self.no_spare = Gauge(
            p + "pool_without_spare",
            "1 when a pool has no spare replica for N+1 redundancy.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.routable = Gauge(
            p + "routable_replicas", "Replicas each pool routes to now.",
            ["model"], registry=registry,
        )  # fmt: skip
