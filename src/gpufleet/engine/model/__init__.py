"""The replica model: continuous batching over a paged KV cache, timed by ``perf``.

One class, :class:`ReplicaModel`, driven by two shells: the sim engine's HTTP server in real
time and the fleet simulator in virtual time. docs/design/replica-model.md explains it.
"""

from gpufleet.engine.model._kv_cache import block_hash_chain
from gpufleet.engine.model._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    external_hash,
)
from gpufleet.engine.model._replica import ReplicaModel, RunAhead, prefill_seconds_per_token
from gpufleet.engine.model._types import (
    DecodeRun,
    FinishReason,
    NewRequest,
    Progress,
    ReplicaConfig,
    ReplicaStats,
    RequestOutput,
    StepPlan,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeRun",
    "FinishReason",
    "KvCacheEvent",
    "NewRequest",
    "Progress",
    "ReplicaConfig",
    "ReplicaModel",
    "ReplicaStats",
    "RequestOutput",
    "RunAhead",
    "StepPlan",
    "block_hash_chain",
    "external_hash",
    "prefill_seconds_per_token",
]
