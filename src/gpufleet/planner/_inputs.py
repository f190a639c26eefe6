"""What a plan is asked for: model, GPUs, precisions, workload, SLOs, fleet policy.

Every default of ``gpufleet plan`` is written here, once.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from gpufleet.perf import Dtype

# A p99 length this many times the mean when the user gives none: the Azure LLM 2023
# conversation trace has p90/mean 2.4 for inputs and 2.0 for outputs (../shared/traces).
DEFAULT_P99_OVER_MEAN = 2.5


class Workload(BaseModel):
    """Offered load. ``rps`` is the mean rate; the fleet is sized for ``rps × peak_to_mean``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rps: PositiveFloat = 10.0
    input_tokens: PositiveInt = 1024
    output_tokens: PositiveInt = 256
    input_p99_tokens: PositiveInt | None = None
    output_p99_tokens: PositiveInt | None = None
    peak_to_mean: float = Field(default=1.0, ge=1.0)

    @model_validator(mode="after")
    def _p99_not_below_mean(self) -> Workload:
        if self.input_p99_tokens is not None and self.input_p99_tokens < self.input_tokens:
            raise ValueError("input_p99_tokens cannot be below input_tokens (the mean)")
        if self.output_p99_tokens is not None and self.output_p99_tokens < self.output_tokens:
            raise ValueError("output_p99_tokens cannot be below output_tokens (the mean)")
        return self

    @property
    def peak_rps(self) -> float:
        return self.rps * self.peak_to_mean

    @property
    def input_p99(self) -> int:
        return self.input_p99_tokens or round(self.input_tokens * DEFAULT_P99_OVER_MEAN)

    @property
    def output_p99(self) -> int:
        return self.output_p99_tokens or round(self.output_tokens * DEFAULT_P99_OVER_MEAN)


class SLO(BaseModel):
    """Latency targets. ``tpot`` is the time between output tokens (inter-token latency)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_p99_ms: PositiveFloat | None = 2000.0
    ttft_p50_ms: PositiveFloat | None = None
    tpot_p50_ms: PositiveFloat | None = 50.0
    tpot_p99_ms: PositiveFloat | None = None


class FleetPolicy(BaseModel):
    """How much headroom and redundancy the fleet carries, and how it is racked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Scale at 60-70 % utilisation (seeds): queues stay short and spikes have room.
    target_utilization: float = Field(default=0.65, gt=0.0, le=1.0)
    # N+1: one spare replica per pool so a GPU failure does not breach the SLO.
    redundancy: int = Field(default=1, ge=0)
    gpus_per_node: PositiveInt = 8
    nodes_per_rack: PositiveInt = 4
    # Air cooling handles about 40 kW per rack (seed 001).
    air_cooled_rack_kw: PositiveFloat = 40.0
    gpu_memory_utilization: float = Field(default=0.90, gt=0.0, le=1.0)
    max_num_batched_tokens: PositiveInt = 8192
    max_num_seqs: PositiveInt = 256
    max_model_len: PositiveInt | None = None
    # Price per GPU-hour overriding the catalog's typical price, by GPU name.
    prices: dict[str, PositiveFloat] = Field(default_factory=dict)


class BatchWorkload(BaseModel):
    """A batch job beside the interactive load: ``lines`` requests to finish within
    ``window_hours``, first on the interactive fleet's spare capacity, the rest on spot GPUs
    of the same type (docs/planner.md, "Batch and spot")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lines: PositiveInt
    input_tokens: PositiveInt | None = None
    """Mean prompt of a line (default: the interactive workload's)."""
    output_tokens: PositiveInt | None = None
    window_hours: PositiveFloat = 24.0
    """The Batch API's ``completion_window``."""
    spare_target: float = Field(default=0.8, gt=0.0, le=1.0)
    """The share of the interactive fleet's capacity batch lines may fill (the gate's
    ``gateway.batch.spare.target``)."""
    spot_discount: float = Field(default=0.7, ge=0.0, lt=1.0)
    """Spot's price below on-demand (seed 004: about 70 %), where ``spot_prices`` names none."""
    spot_prices: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Spot price per GPU-hour, by GPU name."""
    preemptions_per_gpu_hour: float = Field(default=0.05, ge=0.0)
    replace_s: PositiveFloat = 300.0
    """Seconds a preempted replica's capacity is gone: its replacement found and started."""


class PlanRequest(BaseModel):
    """Everything ``plan()`` needs besides the specs themselves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weights_dtype: Dtype = Dtype.BF16
    kv_dtype: Dtype = Dtype.BF16
    workload: Workload = Workload()
    slo: SLO = SLO()
    fleet: FleetPolicy = FleetPolicy()
    batch: BatchWorkload | None = None
    """A batch job to place on spare and spot capacity (``None``: none)."""
