"""The fleet simulator: trace readers, the event kernel, replica drivers, reports and plots.

docs/design/sim-kernel.md explains the kernel and the driver, docs/traces.md the traces.
"""

from gpufleet.sim._arrivals import ArrivalProcess
from gpufleet.sim._harness import Chooser, FleetHarness, RoundRobin
from gpufleet.sim._kernel import NORMAL, URGENT, Event, Kernel, KernelClock, Part, ScheduledEvent
from gpufleet.sim._prompts import PromptBuilder
from gpufleet.sim._recorder import Recorder, RequestLog, RequestRecord
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._stats import LogHistogram
from gpufleet.sim._traces import (
    PREFIX_BLOCK_TOKENS,
    TraceFormat,
    TraceReader,
    TraceRequest,
    detect_format,
    load_trace,
)

__all__ = [
    "NORMAL",
    "PREFIX_BLOCK_TOKENS",
    "URGENT",
    "ArrivalProcess",
    "Chooser",
    "Event",
    "FleetHarness",
    "Kernel",
    "KernelClock",
    "LogHistogram",
    "Part",
    "PromptBuilder",
    "Recorder",
    "ReplicaDriver",
    "RequestLog",
    "RequestRecord",
    "RoundRobin",
    "ScheduledEvent",
    "TraceFormat",
    "TraceReader",
    "TraceRequest",
    "detect_format",
    "load_trace",
]
