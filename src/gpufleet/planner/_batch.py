"""A batch job on a plan: spare capacity first, then a spot pool, priced against on-demand.

The interactive fleet is sized for its peak at a target utilisation, so at its mean load it
has room; the spare-capacity gate fills it up to ``spare_target`` (docs/batch.md). Per GPU
plan that meets the SLO::

    line rate r     one replica at its highest throughput for the lines' shape (no latency
                    target: batch lines wait), from the same step-time model
    spare           (replicas × spare_target − mean rps ÷ interactive rps per replica)
                    replica-equivalents × r × window  lines
    spot            the rest, on replicas of the same layout whose capacity is lost
                    preemptions/GPU-h × GPUs × replace_s of every hour:
                    replicas = ⌈rest ÷ (r × window × available)⌉
    on-demand       the same rest on on-demand replicas (always available)
    preemptions     rate × GPUs × spot replicas × window; each sends the lines it ran back
                    to the queue (its concurrency's worth, an upper bound on lines re-run)

Prices: the plan's on-demand price per GPU-hour, and spot at ``spot_prices[gpu]`` or
``(1 − spot_discount)`` × on-demand. The rates come from the performance model with no
queueing, as the rest of the plan's; ``gpufleet simulate --batch … --fault spot:…`` replays
the same job on a trace with preemptions.
"""

from __future__ import annotations

import math

from gpufleet.perf import MemoryPlan, StepTimeModel
from gpufleet.planner._inputs import SLO, BatchWorkload, PlanRequest, Workload
from gpufleet.planner._operating import (
    OperatingPoint,
    best_operating_point,
    kv_concurrency_limit,
)
from gpufleet.planner._report import BatchReport

_NO_TARGET = SLO(ttft_p99_ms=None, ttft_p50_ms=None, tpot_p50_ms=None, tpot_p99_ms=None)


def batch_shape(request: PlanRequest, batch: BatchWorkload) -> Workload:
    """The lines' mean shape (the interactive workload's where the job names none)."""
    w = request.workload
    return Workload(
        rps=w.rps,
        input_tokens=batch.input_tokens or w.input_tokens,
        output_tokens=batch.output_tokens or w.output_tokens,
    )


def lines_point(
    stm: StepTimeModel, memory: MemoryPlan, request: PlanRequest, shape: Workload
) -> OperatingPoint | None:
    """One replica running lines of ``shape`` at its highest throughput: as many at once as
    its KV cache holds at their mean context and ``max_num_seqs`` allow, no latency target."""
    fleet = request.fleet
    cap = min(kv_concurrency_limit(memory, shape), fleet.max_num_seqs)
    best, _ = best_operating_point(stm, shape, _NO_TARGET, fleet.max_num_batched_tokens, cap)
    return best


def batch_report(  # noqa: PLR0917 - a plan's numbers, as plan_gpu has them
    batch: BatchWorkload,
    request: PlanRequest,
    gpu: str,
    gpus_per_replica: int,
    replicas: int,
    interactive_rps_per_replica: float,
    price: float,
    point: OperatingPoint,
) -> BatchReport:
    """The batch job on a plan of ``replicas`` replicas of ``gpus_per_replica`` GPUs that
    each serve ``interactive_rps_per_replica`` interactive requests at the SLO, priced at
    ``price`` per on-demand GPU-hour; ``point``: one replica running the lines."""
    rate = point.requests_per_s
    window_s = batch.window_hours * 3600.0
    used = request.workload.rps / interactive_rps_per_replica  # replicas the mean load takes
    spare_replicas = max(0.0, replicas * batch.spare_target - used)
    spare = min(batch.lines, math.floor(spare_replicas * rate * window_s))
    rest = batch.lines - spare
    per_replica = rate * window_s
    down = batch.preemptions_per_gpu_hour * gpus_per_replica * batch.replace_s / 3600.0
    available = max(1e-9, 1.0 - down)
    spot_replicas = math.ceil(rest / (per_replica * available)) if rest else 0
    on_demand_replicas = math.ceil(rest / per_replica) if rest else 0
    spot_price = batch.spot_prices.get(gpu, price * (1.0 - batch.spot_discount))
    hours = batch.window_hours
    spot_cost = spot_replicas * gpus_per_replica * spot_price * hours
    on_demand_cost = on_demand_replicas * gpus_per_replica * price * hours
    preemptions = batch.preemptions_per_gpu_hour * gpus_per_replica * spot_replicas * hours
    return BatchReport(
        lines=batch.lines,
        window_hours=hours,
        lines_per_s_per_replica=round(rate, 4),
        spare_lines=spare,
        spot_lines=rest,
        spot_share=round(rest / batch.lines, 4),
        spot_replicas=spot_replicas,
        spot_price_per_gpu_hour_usd=round(spot_price, 4),
        spot_cost_usd=round(spot_cost, 2),
        expected_preemptions=round(preemptions, 2),
        expected_rerun_lines=round(preemptions * point.concurrency, 1),
        on_demand_replicas=on_demand_replicas,
        on_demand_cost_usd=round(on_demand_cost, 2),
        savings=0.0 if not on_demand_cost else round(1.0 - spot_cost / on_demand_cost, 4),
    )
