"""Domain types of the control plane: replicas, their states and engine profiles, fleet views,
requests, events (KV-cache events too), and the OpenAI batch lifecycle (a batch's statuses
and its input file's lines).

Values only (frozen dataclasses and enums): the gateway and the simulator build them, the
policies in ``gpufleet.policy`` read them.
"""

from gpufleet.fleet._batch import (
    BATCH_CANCEL_GRACE_S,
    BATCH_CANCELLABLE,
    BATCH_ENDPOINTS,
    BATCH_RUNNING,
    BATCH_TERMINAL,
    BATCH_TIMESTAMPS,
    BATCH_TRANSITIONS,
    BATCH_WINDOWS,
    BatchProgress,
    BatchStatus,
    RequestCounts,
    batch_can_move,
    batch_sources,
    next_batch_status,
)
from gpufleet.fleet._batch_input import (
    MAX_BATCH_LINES,
    BatchInput,
    BatchRequest,
    LineError,
    parse_batch_input,
    prefix_ranks,
    prompt_text,
)
from gpufleet.fleet._engine_metrics import (
    ENGINE_METRICS,
    EngineMetrics,
    EngineSignal,
    Histogram,
    read_engine_metrics,
)
from gpufleet.fleet._events import FleetEvent, ProbeResult, RequestFinished
from gpufleet.fleet._kv import KvBatch, KvCleared, KvEvent, KvRemoved, KvStored
from gpufleet.fleet._profile import (
    DEFAULT_MAX_NUM_SEQS,
    ENGINE_FLAGS,
    LORA_SETTINGS,
    LoraModule,
    ReplicaProfile,
)
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
    "BATCH_CANCELLABLE",
    "BATCH_CANCEL_GRACE_S",
    "BATCH_ENDPOINTS",
    "BATCH_RUNNING",
    "BATCH_TERMINAL",
    "BATCH_TIMESTAMPS",
    "BATCH_TRANSITIONS",
    "BATCH_WINDOWS",
    "DEFAULT_MAX_NUM_SEQS",
    "ENGINE_FLAGS",
    "ENGINE_METRICS",
    "FAILURES",
    "IN_SERVICE",
    "LOCAL_ORIGIN_FAILURES",
    "LORA_SETTINGS",
    "MAX_BATCH_LINES",
    "NO_LOAD",
    "REPLICA_ORIGIN_FAILURES",
    "ROUTABLE",
    "BatchInput",
    "BatchProgress",
    "BatchRequest",
    "BatchStatus",
    "EngineMetrics",
    "EngineSignal",
    "FleetEvent",
    "FleetView",
    "Histogram",
    "KvBatch",
    "KvCleared",
    "KvEvent",
    "KvRemoved",
    "KvStored",
    "LineError",
    "LoraModule",
    "Outcome",
    "ProbeResult",
    "ReplicaId",
    "ReplicaLoad",
    "ReplicaProfile",
    "ReplicaState",
    "ReplicaView",
    "RequestCounts",
    "RequestFinished",
    "RouteRequest",
    "batch_can_move",
    "batch_sources",
    "next_batch_status",
    "parse_batch_input",
    "prefix_ranks",
    "prompt_text",
    "read_engine_metrics",
    "text_prefix_hashes",
]
