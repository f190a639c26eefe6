"""The sim engine server: vLLM's OpenAI-compatible HTTP API over one modelled replica."""

from gpufleet.engine.server._app import create_app
from gpufleet.engine.server._clock import Clock, ScaledClock, VirtualClock
from gpufleet.engine.server._config import (
    FaultConfig,
    KvEventsConfig,
    LoraModuleConfig,
    SimEngineConfig,
)
from gpufleet.engine.server._dcgm import DCGM_LABELS, DcgmCollector, GpuActivity
from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import ApiError
from gpufleet.engine.server._faults import CRASH_EXIT_STATUS, Faults
from gpufleet.engine.server._kv_hasher import SimBlockHasher
from gpufleet.engine.server._kv_publish import KvEventPublisher
from gpufleet.engine.server._loop import EngineDeadError, EngineLoop, RequestStream
from gpufleet.engine.server._metrics import EngineMetrics

__all__ = [
    "CRASH_EXIT_STATUS",
    "DCGM_LABELS",
    "ApiError",
    "Clock",
    "DcgmCollector",
    "EngineDeadError",
    "EngineLoop",
    "EngineMetrics",
    "FaultConfig",
    "Faults",
    "GpuActivity",
    "KvEventPublisher",
    "KvEventsConfig",
    "LoraModuleConfig",
    "RequestStream",
    "ScaledClock",
    "SimBlockHasher",
    "SimEngine",
    "SimEngineConfig",
    "VirtualClock",
    "create_app",
]
