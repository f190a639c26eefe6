"""Domain types of the control plane: replicas, their states and engine profiles, fleet views,
requests, events.

Values only (frozen dataclasses and enums): the gateway and the simulator build them, the
policies in ``gpufleet.policy`` read them.
"""

from gpufleet.fleet._engine_metrics import (
    ENGINE_METRICS,
    EngineMetrics,
    EngineSignal,
    Histogram,
    read_engine_metrics,
)
from gpufleet.fleet._events import FleetEvent, ProbeResult, RequestFinished
from gpufleet.fleet._profile import DEFAULT_MAX_NUM_SEQS, ENGINE_FLAGS, ReplicaProfile
from gpufleet.fleet._replica import (
    IN_SERVICE,
    NO_LOAD,
    ROUTABLE,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
)
from gpufleet.fleet._request import (
    FAILURES,
    LOCAL_ORIGIN_FAILURES,
    REPLICA_ORIGIN_FAILURES,
    Outcome,
    RouteRequest,
    text_prefix_hashes,
)
from gpufleet.fleet._view import FleetView

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "ENGINE_FLAGS",
    "ENGINE_METRICS",
    "FAILURES",
    "IN_SERVICE",
    "LOCAL_ORIGIN_FAILURES",
    "NO_LOAD",
    "REPLICA_ORIGIN_FAILURES",
    "ROUTABLE",
    "EngineMetrics",
    "EngineSignal",
    "FleetEvent",
    "FleetView",
    "Histogram",
    "Outcome",
    "ProbeResult",
    "ReplicaId",
    "ReplicaLoad",
    "ReplicaProfile",
    "ReplicaState",
    "ReplicaView",
    "RequestFinished",
    "RouteRequest",
    "read_engine_metrics",
    "text_prefix_hashes",
]
