"""The plan as data: what ``gpufleet plan --json`` prints (schema: docs/plan-schema.json)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gpufleet.planner._inputs import SLO, FleetPolicy, Workload

SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryReport(_Frozen):
    """One GPU of the replica (the most loaded one), in GiB."""

    total_gib: float
    usable_gib: float
    weights_gib: float
    activation_gib: float
    overhead_gib: float
    kv_cache_gib: float


class KVReport(_Frozen):
    """KV-cache capacity of one replica and the concurrency it supports."""

    bytes_per_token: int
    tokens: int
    blocks: int
    block_size: int
    concurrency_at_mean_context: int
    concurrency_at_p99_context: int
    concurrency_at_max_model_len: int
    mean_context: int
    p99_context: int
    max_model_len: int


class LatencyReport(_Frozen):
    """Predicted latencies at the operating point, in milliseconds."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float


class ThroughputReport(_Frozen):
    """One replica at its operating point."""

    concurrency: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s_per_gpu: float
    bound: str


class CandidateReport(_Frozen):
    """One parallelism the planner weighed."""

    tp: int
    pp: int
    gpus: int
    fits: bool
    meets_slo: bool
    requests_per_s_per_gpu: float | None
    note: str


class ReplicaCount(_Frozen):
    for_peak: int
    redundancy: int
    total: int
    peak_rps: float
    utilization_at_peak: float


class CostReport(_Frozen):
    price_per_gpu_hour_usd: float
    per_hour_usd: float
    per_million_tokens_usd: float
    per_million_output_tokens_usd: float


class PowerReport(_Frozen):
    kw_per_replica: float
    kw_fleet: float
    kw_per_rack: float
    nodes_per_rack: int
    air_cooling_ok: bool


class BatchReport(_Frozen):
    """A batch job on this plan: what the interactive fleet's spare capacity runs within its
    window, and a spot pool of the same replicas for the rest, against on-demand."""

    lines: int
    window_hours: float
    lines_per_s_per_replica: float
    """One replica at its highest throughput for the lines' shape (no latency target)."""
    spare_lines: int
    """Lines the interactive fleet runs in the window on what its mean load leaves, filled up
    to ``spare_target`` of its capacity."""
    spot_lines: int
    spot_share: float
    """Of the lines, the share proposed for spot."""
    spot_replicas: int
    spot_price_per_gpu_hour_usd: float
    spot_cost_usd: float
    """The spot pool for the window, its preemptions' lost time included."""
    expected_preemptions: float
    expected_rerun_lines: float
    """Lines in flight on a preempted replica run again (half a line's work lost each, on
    average, counted as a whole line here)."""
    on_demand_replicas: int
    on_demand_cost_usd: float
    """The same lines on on-demand replicas instead."""
    savings: float
    """1 − spot cost ÷ on-demand cost."""


class GPUPlan(_Frozen):
    """The plan of the fleet on one GPU type. Fields after ``status`` are null when it fails."""

    gpu: str
    gpu_display_name: str
    status: str  # "meets_slo", "misses_slo" or "does_not_fit"
    reason: str
    min_gpus_per_replica: int | None
    tp: int | None
    pp: int | None
    gpus_per_replica: int | None
    memory: MemoryReport | None
    kv: KVReport | None
    latency: LatencyReport | None
    throughput: ThroughputReport | None
    replicas: ReplicaCount | None
    gpus_total: int | None
    cost: CostReport | None
    power: PowerReport | None
    candidates: list[CandidateReport]
    warnings: list[str]
    batch: BatchReport | None = None
    """The request's batch job on this plan (one that meets the SLO), if it named one."""


class PlanReport(_Frozen):
    """The whole answer: one plan per GPU type, ranked (cheapest that meets the SLO first)."""

    schema_version: int = SCHEMA_VERSION
    model: str
    model_params_b: float
    model_active_params_b: float
    weights_dtype: str
    kv_dtype: str
    workload: Workload
    slo: SLO
    fleet: FleetPolicy
    recommended: str | None
    plans: list[GPUPlan]
    notes: list[str]
