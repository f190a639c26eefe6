"""Replicas as the control plane sees them: identity, lifecycle state, load.

A replica's state is the product of two owners, combined in one value::

    runtime (where it runs)          health (policy.health)           routing reads
    STARTING  process launched  ─┐
    READY     process serving   ─┼─► READY unless ejected / failing ─► ReplicaView.state
    DRAINING  no new work       ─┤   EJECTED (outlier, timed)
    STOPPED   gone              ─┤   FAILED  (active checks fail)
    FAILED    crashed           ─┘   STARTING (not yet probed healthy)

The sets below name every question asked of a state; nothing compares states by order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, NewType

ReplicaId = NewType("ReplicaId", str)
"""A replica's deterministic name, unique in the fleet (``"llama-8b-0"``)."""


class ReplicaState(StrEnum):
    """Where a replica is in its life; see the module docstring for who sets which."""

    STARTING = "starting"
    """Launched (or restarted) but not yet known to serve: no traffic."""
    READY = "ready"
    """Serving and healthy: takes new requests."""
    DRAINING = "draining"
    """Finishing its in-flight requests before it stops (scale-in, rollout): no new work."""
    EJECTED = "ejected"
    """Taken out by outlier detection for a while; readmitted after a recovery probe."""
    FAILED = "failed"
    """Crashed, or failing its active health checks."""
    STOPPED = "stopped"
    """Gone for good; kept in a view only until the runtime forgets it."""


ROUTABLE: Final = frozenset({ReplicaState.READY})
"""States that take new requests."""

IN_SERVICE: Final = frozenset({ReplicaState.READY, ReplicaState.EJECTED, ReplicaState.FAILED})
"""States that count as the pool's capacity, healthy or not: the denominator of the panic
threshold and of the ejection limit, and the replicas a pool in panic routes over. A replica
that is starting, draining or stopped is neither capacity nor a panic target."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load: the gateway's own count plus the engine's last ``/metrics`` scrape.

    ``in_flight`` is the gateway-side count of requests sent and not yet finished when the
    view was taken. Routers keep their own copy of this count, moved by every
    ``on_request_start`` / ``on_request_end`` between views, and read that one.

    The other fields come from the replica's Prometheus endpoint in vLLM's names
    (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits`` / ``..._queries``), scraped at
    ``observed_at`` (seconds on the control plane's clock); ``observed_at=None`` means never
    scraped, and the scraped fields are then zero and meaningless.
    """

    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    observed_at: float | None = None
    prefix_cache_hit_rate: float | None = None
    """Hits / queries over the scraper's window, or ``None`` when the engine reports none."""

    def __post_init__(self) -> None:
        for name in ("in_flight", "running", "waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("kv_cache_usage", "prefix_cache_hit_rate"):
            value = getattr(self, name)
            if value is not None and not (0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.observed_at is not None and not math.isfinite(self.observed_at):
            raise ValueError(f"observed_at must be finite, got {self.observed_at}")


NO_LOAD: Final = ReplicaLoad()
"""The load of a replica that has served nothing and was never scraped."""


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica in a fleet snapshot: who, which model, which state, how loaded."""

    id: ReplicaId
    model: str
    """The model it serves; the replicas of one model form a pool."""
    state: ReplicaState
    load: ReplicaLoad = NO_LOAD
