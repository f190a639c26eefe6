"""The performance model: memory arithmetic and the step time of one engine iteration."""

from gpufleet.perf._calibration import (
    Calibration,
    CalibrationError,
    Efficiency,
    LinkEfficiency,
    efficiency_for,
    load_calibration,
)
from gpufleet.perf._dtype import KV_DTYPES, Dtype, parse_dtype
from gpufleet.perf._lora import (
    ALL_LINEAR,
    ATTENTION,
    LOAD_OVERHEAD_S,
    UNLOAD_S,
    lora_bytes,
    lora_load_seconds,
)
from gpufleet.perf._memory import (
    GIB,
    EngineLimits,
    MemoryPlan,
    Overheads,
    Parallelism,
    activation_bytes,
    kv_bytes_per_token,
    memory_plan,
    weight_bytes,
)
from gpufleet.perf._residency import (
    PINNED_COPY_EFFICIENCY,
    STORAGE_GB_S,
    ResidencyTimes,
    residency_times,
)
from gpufleet.perf._step import BatchShape, Bound, StepTime, StepTimeModel

__all__ = [
    "ALL_LINEAR",
    "ATTENTION",
    "GIB",
    "KV_DTYPES",
    "LOAD_OVERHEAD_S",
    "PINNED_COPY_EFFICIENCY",
    "STORAGE_GB_S",
    "UNLOAD_S",
    "BatchShape",
    "Bound",
    "Calibration",
    "CalibrationError",
    "Dtype",
    "Efficiency",
    "EngineLimits",
    "LinkEfficiency",
    "MemoryPlan",
    "Overheads",
    "Parallelism",
    "ResidencyTimes",
    "StepTime",
    "StepTimeModel",
    "activation_bytes",
    "efficiency_for",
    "kv_bytes_per_token",
    "load_calibration",
    "lora_bytes",
    "lora_load_seconds",
    "memory_plan",
    "parse_dtype",
    "residency_times",
    "weight_bytes",
]
