"""The fleet simulator: trace readers, the event kernel, replica drivers, reports and plots.

docs/design/sim-kernel.md explains the kernel and the driver, docs/traces.md the traces.
"""

from gpufleet.sim._admission import SimTenant, TenantMix, parse_tenant
from gpufleet.sim._arrivals import ArrivalProcess
from gpufleet.sim._autoscale import Phase
from gpufleet.sim._batch_job import BATCH_JOB, BatchJob, parse_batch_job
from gpufleet.sim._chaos import ChaosResult, ChaosScenario, chaos_run, chaos_scenario
from gpufleet.sim._control import (
    SimControl,
    token_prefix_hashes,
)
from gpufleet.sim._faults import (
    BlackoutFault,
    CrashFault,
    ErrorFault,
    Fault,
    FaultInjector,
    HangFault,
    MtbfFault,
    SlowFault,
    SpotFault,
    SpotOutageFault,
    load_faults,
    parse_fault,
)
from gpufleet.sim._harness import (
    Chooser,
    ChooserRouting,
    FleetHarness,
    Gate,
    RoundRobin,
    Routing,
)
from gpufleet.sim._kernel import NORMAL, URGENT, Event, Kernel, Part, ScheduledEvent
from gpufleet.sim._plots import write_plots
from gpufleet.sim._prompts import PromptBuilder
from gpufleet.sim._recorder import Recorder, RequestLog, RequestRecord
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._simulate import FleetSimulation, SimOptions, prefill_speeds, replica_config
from gpufleet.sim._stats import LogHistogram
from gpufleet.sim._sweep import (
    SLOTarget,
    SweepCandidate,
    SweepProgress,
    SweepResult,
    SweepRun,
    SweepStatus,
    TraceSpec,
    cheapest_met,
    pareto_front,
    run_sweep,
)
from gpufleet.sim._sweep_plot import write_pareto_plot
from gpufleet.sim._synth import (
    DEFAULT_SPIKES,
    DiurnalCurve,
    Spike,
    synth_requests,
    zipf_models,
    zipf_weights,
)
from gpufleet.sim._traces import (
    PREFIX_BLOCK_TOKENS,
    PREFIX_HASH_TOKENS,
    SAMPLE_TRACE,
    TraceFormat,
    TraceReader,
    TraceRequest,
    detect_format,
    load_trace,
)

__all__ = [
    "BATCH_JOB",
    "DEFAULT_SPIKES",
    "NORMAL",
    "PREFIX_BLOCK_TOKENS",
    "PREFIX_HASH_TOKENS",
    "SAMPLE_TRACE",
    "URGENT",
    "ArrivalProcess",
    "BatchJob",
    "BlackoutFault",
    "ChaosResult",
    "ChaosScenario",
    "Chooser",
    "ChooserRouting",
    "CrashFault",
    "DiurnalCurve",
    "ErrorFault",
    "Event",
    "Fault",
    "FaultInjector",
    "FleetHarness",
    "FleetSimulation",
    "Gate",
    "HangFault",
    "Kernel",
    "LogHistogram",
    "MtbfFault",
    "Part",
    "Phase",
    "PromptBuilder",
    "Recorder",
    "ReplicaDriver",
    "RequestLog",
    "RequestRecord",
    "RoundRobin",
    "Routing",
    "SLOTarget",
    "ScheduledEvent",
    "SimControl",
    "SimOptions",
    "SimTenant",
    "SlowFault",
    "Spike",
    "SpotFault",
    "SpotOutageFault",
    "SweepCandidate",
    "SweepProgress",
    "SweepResult",
    "SweepRun",
    "SweepStatus",
    "TenantMix",
    "TraceFormat",
    "TraceReader",
    "TraceRequest",
    "TraceSpec",
    "chaos_run",
    "chaos_scenario",
    "cheapest_met",
    "detect_format",
    "load_faults",
    "load_trace",
    "pareto_front",
    "parse_batch_job",
    "parse_fault",
    "parse_tenant",
    "prefill_speeds",
    "replica_config",
    "run_sweep",
    "synth_requests",
    "token_prefix_hashes",
    "write_pareto_plot",
    "write_plots",
    "zipf_models",
    "zipf_weights",
]
