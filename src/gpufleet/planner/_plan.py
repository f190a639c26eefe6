"""Capacity planning: from a model, GPU types, a workload and SLOs to a fleet per GPU type.

For each GPU type the planner

1. lays out memory for every parallelism that could hold the model (TP within a node; PP
   across nodes only when a whole node is not enough),
2. finds each layout's best operating point under the SLO (``_operating``),
3. keeps the layout with the most requests per second per GPU (the cheapest per token),
4. sizes the pool for the peak at the target utilisation, adds the redundant replicas,
5. prices it and adds up its power,

then ranks the GPU types: those that meet the SLO first, cheapest per hour first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf import GIB, EngineLimits, MemoryPlan, Parallelism, StepTimeModel, memory_plan
from gpufleet.planner._batch import batch_report, batch_shape, lines_point
from gpufleet.planner._inputs import PlanRequest
from gpufleet.planner._operating import (
    OperatingPoint,
    best_operating_point,
    kv_concurrency_limit,
)
from gpufleet.planner._power import watts_per_gpu_slot
from gpufleet.planner._report import (
    CandidateReport,
    CostReport,
    GPUPlan,
    KVReport,
    LatencyReport,
    MemoryReport,
    PlanReport,
    PowerReport,
    ReplicaCount,
    ThroughputReport,
)

MAX_PIPELINE_STAGES = 8


class PlanError(ValueError):
    """The request cannot be planned at all (for example: the model fits on no GPU given)."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    parallel: Parallelism
    memory: MemoryPlan
    point: OperatingPoint | None
    single: OperatingPoint | None
    note: str

    @property
    def per_gpu(self) -> float | None:
        if self.point is None:
            return None
        return self.point.requests_per_s / self.parallel.gpus


def _tensor_layouts(model: ModelSpec, gpus_per_node: int) -> list[Parallelism]:
    """TP of 1, 2, 4, 8 within a node, where TP divides the attention heads."""
    layouts = []
    for tp in (1, 2, 4, 8, 16):
        if tp > gpus_per_node:
            break
        try:
            Parallelism(tp=tp).check(model)
        except ValueError:
            continue
        layouts.append(Parallelism(tp=tp))
    return layouts


def _pipeline_layouts(model: ModelSpec, widest: Parallelism) -> list[Parallelism]:
    """Whole nodes as pipeline stages: only when one node cannot hold the model."""
    last = min(MAX_PIPELINE_STAGES, model.num_layers)
    return [Parallelism(tp=widest.tp, pp=pp) for pp in range(2, last + 1)]


def _context_sizes(model: ModelSpec, request: PlanRequest) -> tuple[int, int, int]:
    w = request.workload
    max_len = request.fleet.max_model_len or model.max_context
    mean = w.input_tokens + w.output_tokens
    p99 = min(w.input_p99 + w.output_p99, max_len)
    return mean, p99, max_len


def _limits(request: PlanRequest) -> EngineLimits:
    f = request.fleet
    return EngineLimits(
        gpu_memory_utilization=f.gpu_memory_utilization,
        max_num_batched_tokens=f.max_num_batched_tokens,
        max_num_seqs=f.max_num_seqs,
    )


def _evaluate(
    model: ModelSpec, gpu: GPUSpec, parallel: Parallelism, request: PlanRequest
) -> _Candidate:
    limits = _limits(request)
    memory = memory_plan(
        model,
        gpu,
        parallel=parallel,
        weights_dtype=request.weights_dtype,
        kv_dtype=request.kv_dtype,
        limits=limits,
    )
    _, p99_context, _ = _context_sizes(model, request)
    if not memory.fits:
        need = (memory.weights + memory.activation + memory.overhead) / GIB
        note = f"needs {need:.1f} GiB per GPU, {memory.usable / GIB:.1f} GiB usable"
        return _Candidate(parallel, memory, None, None, note)
    if memory.kv_tokens < p99_context:
        note = f"KV cache holds {memory.kv_tokens} tokens, less than one p99 request"
        return _Candidate(parallel, memory, None, None, note)
    stm = _step_model(model, gpu, parallel, request)
    cap = min(kv_concurrency_limit(memory, request.workload), limits.max_num_seqs)
    point, single = best_operating_point(
        stm, request.workload, request.slo, limits.max_num_batched_tokens, cap
    )
    if point is None:
        missed = single.misses(request.slo) if single else ["token budget too small"]
        note = "misses the SLO even one request at a time: " + "; ".join(missed)
    else:
        note = f"{point.requests_per_s / parallel.gpus:.2f} req/s per GPU at concurrency " + str(
            point.concurrency
        )
    return _Candidate(parallel, memory, point, single, note)


def _step_model(
    model: ModelSpec, gpu: GPUSpec, parallel: Parallelism, request: PlanRequest
) -> StepTimeModel:
    return StepTimeModel(
        model,
        gpu,
        tp=parallel.tp,
        pp=parallel.pp,
        weights_dtype=request.weights_dtype,
        kv_dtype=request.kv_dtype,
    )


def _memory_report(memory: MemoryPlan) -> MemoryReport:
    def gib(value: float) -> float:
        return round(value / GIB, 2)

    return MemoryReport(
        total_gib=gib(memory.total),
        usable_gib=gib(memory.usable),
        weights_gib=gib(memory.weights),
        activation_gib=gib(memory.activation),
        overhead_gib=gib(memory.overhead),
        kv_cache_gib=gib(max(memory.kv_cache, 0)),
    )


def _kv_report(memory: MemoryPlan, model: ModelSpec, request: PlanRequest) -> KVReport:
    mean, p99, max_len = _context_sizes(model, request)
    return KVReport(
        bytes_per_token=memory.kv_bytes_per_token,
        tokens=memory.kv_tokens,
        blocks=memory.kv_blocks,
        block_size=memory.block_size,
        concurrency_at_mean_context=memory.max_concurrency(mean),
        concurrency_at_p99_context=memory.max_concurrency(p99),
        concurrency_at_max_model_len=memory.max_concurrency(max_len),
        mean_context=mean,
        p99_context=p99,
        max_model_len=max_len,
    )


def _choose(candidates: list[_Candidate]) -> _Candidate | None:
    meeting = [c for c in candidates if c.point is not None]
    if meeting:
        return max(meeting, key=lambda c: (c.per_gpu or 0.0, -c.parallel.gpus))
    runnable = [c for c in candidates if c.single is not None]
    if runnable:  # nothing meets the SLO: show the fastest layout one request at a time
        return min(runnable, key=lambda c: c.single.ttft_p99_s if c.single else math.inf)
    return None


def _reason(chosen: _Candidate, candidates: list[_Candidate], min_gpus: int) -> str:
    parts = []
    if min_gpus > 1:
        parts.append(f"weights need at least {min_gpus} GPUs")
    if chosen.point is None:
        parts.append(chosen.note)
    else:
        others = [
            f"TP{c.parallel.tp}×PP{c.parallel.pp}: {c.per_gpu:.2f}"
            for c in candidates
            if c is not chosen and c.per_gpu is not None
        ]
        text = (
            f"TP{chosen.parallel.tp}×PP{chosen.parallel.pp} gives the most requests/s per GPU "
            f"at the SLO ({chosen.per_gpu:.2f})"
        )
        if others:
            text += "; " + ", ".join(others)
        parts.append(text)
    return "; ".join(parts)


def _warnings(gpu: GPUSpec, chosen: _Candidate, kv: KVReport, request: PlanRequest) -> list[str]:
    warnings = []
    par = chosen.parallel
    if par.tp > 1 and not gpu.interconnect.has_scale_up_link:
        warnings.append(
            f"tensor parallelism over PCIe only ({gpu.interconnect.pcie_gb_s:.0f} GB/s): "
            "every layer's all-reduce crosses PCIe; prefer NVLink GPUs or more replicas"
        )
    if par.pp > 1:
        warnings.append(
            f"pipeline parallelism over {par.pp} nodes: needs a non-blocking fabric "
            "(InfiniBand/RoCE) between them, and raises per-token latency"
        )
    if kv.concurrency_at_max_model_len < 1:
        warnings.append(
            f"the KV cache ({kv.tokens} tokens) cannot hold one max_model_len request "
            f"({kv.max_model_len}); set max_model_len to at most {kv.tokens}"
        )
    if request.weights_dtype.value == "fp8" and gpu.fp8_tflops is None:
        warnings.append(f"{gpu.name} has no FP8 tensor cores: fp8 weights run weight-only")
    return warnings


def _failed(gpu: GPUSpec, status: str, reason: str, candidates: list[_Candidate]) -> GPUPlan:
    return GPUPlan(
        gpu=gpu.name,
        gpu_display_name=gpu.display_name,
        status=status,
        reason=reason,
        min_gpus_per_replica=None,
        tp=None,
        pp=None,
        gpus_per_replica=None,
        memory=None,
        kv=None,
        latency=None,
        throughput=None,
        replicas=None,
        gpus_total=None,
        cost=None,
        power=None,
        candidates=[_candidate_report(c) for c in candidates],
        warnings=[],
    )


def _candidate_report(c: _Candidate) -> CandidateReport:
    return CandidateReport(
        tp=c.parallel.tp,
        pp=c.parallel.pp,
        gpus=c.parallel.gpus,
        fits=c.memory.fits,
        meets_slo=c.point is not None,
        requests_per_s_per_gpu=None if c.per_gpu is None else round(c.per_gpu, 4),
        note=c.note,
    )


def plan_gpu(model: ModelSpec, gpu: GPUSpec, request: PlanRequest) -> GPUPlan:
    """The fleet on one GPU type."""
    price = request.fleet.prices.get(gpu.name, gpu.price_per_hour_usd)
    layouts = _tensor_layouts(model, request.fleet.gpus_per_node)
    candidates = [_evaluate(model, gpu, par, request) for par in layouts]
    if layouts and not any(c.memory.fits for c in candidates):
        for par in _pipeline_layouts(model, layouts[-1]):
            candidates.append(_evaluate(model, gpu, par, request))
            if candidates[-1].memory.fits:  # the fewest stages that hold it, then stop
                break
    fitting = [c for c in candidates if c.memory.fits]
    if not fitting:
        return _failed(
            gpu,
            "does_not_fit",
            "the weights fit no layout up to "
            f"{MAX_PIPELINE_STAGES} nodes of {request.fleet.gpus_per_node}",
            candidates,
        )
    min_gpus = min(c.parallel.gpus for c in fitting)
    chosen = _choose(candidates)
    if chosen is None:
        return _failed(gpu, "does_not_fit", fitting[0].note, candidates)
    kv = _kv_report(chosen.memory, model, request)
    point = chosen.point or chosen.single
    assert point is not None  # _choose only returns layouts that ran
    w, fleet = request.workload, request.fleet
    par = chosen.parallel
    meets = chosen.point is not None
    slot_watts = watts_per_gpu_slot(gpu)
    rack_kw = fleet.nodes_per_rack * fleet.gpus_per_node * slot_watts / 1000
    fleet_size = _fleet_size(point, par, request, price) if meets else None
    batch = None
    if request.batch is not None and fleet_size is not None:
        shape = batch_shape(request, request.batch)
        lines = lines_point(_step_model(model, gpu, par, request), chosen.memory, request, shape)
        if lines is not None:
            total = fleet_size.replicas.total
            batch = batch_report(
                request.batch, request, gpu.name, par.gpus, total, point.requests_per_s,
                price, lines,
            )  # fmt: skip
    warnings = _warnings(gpu, chosen, kv, request)
    if rack_kw > fleet.air_cooled_rack_kw:
        warnings.append(
            f"a rack of {fleet.nodes_per_rack} such nodes draws {rack_kw:.1f} kW, past the "
            f"~{fleet.air_cooled_rack_kw:.0f} kW air cooling handles: plan liquid cooling "
            "or fewer nodes per rack"
        )
    return GPUPlan(
        gpu=gpu.name,
        gpu_display_name=gpu.display_name,
        status="meets_slo" if meets else "misses_slo",
        reason=_reason(chosen, candidates, min_gpus),
        min_gpus_per_replica=min_gpus,
        tp=par.tp,
        pp=par.pp,
        gpus_per_replica=par.gpus,
        memory=_memory_report(chosen.memory),
        kv=kv,
        latency=LatencyReport(
            ttft_p50_ms=round(point.ttft_p50_s * 1000, 1),
            ttft_p99_ms=round(point.ttft_p99_s * 1000, 1),
            tpot_p50_ms=round(point.tpot_p50_s * 1000, 2),
            tpot_p99_ms=round(point.tpot_p99_s * 1000, 2),
        ),
        throughput=ThroughputReport(
            concurrency=point.concurrency,
            requests_per_s=round(point.requests_per_s, 4),
            output_tokens_per_s=round(point.requests_per_s * w.output_tokens, 1),
            total_tokens_per_s=round(point.requests_per_s * (w.input_tokens + w.output_tokens), 1),
            requests_per_s_per_gpu=round(point.requests_per_s / par.gpus, 4),
            bound=point.bound,
        ),
        replicas=fleet_size.replicas if fleet_size else None,
        gpus_total=fleet_size.replicas.total * par.gpus if fleet_size else None,
        cost=fleet_size.cost if fleet_size else None,
        power=fleet_size.power(slot_watts, rack_kw, fleet.air_cooled_rack_kw, par.gpus)
        if fleet_size
        else None,
        candidates=[_candidate_report(c) for c in candidates],
        warnings=warnings,
        batch=batch,
    )


@dataclass(frozen=True, slots=True)
class _FleetSize:
    replicas: ReplicaCount
    cost: CostReport
    nodes_per_rack: int

    def power(self, slot_watts: float, rack_kw: float, air_kw: float, gpus: int) -> PowerReport:
        return PowerReport(
            kw_per_replica=round(gpus * slot_watts / 1000, 2),
            kw_fleet=round(self.replicas.total * gpus * slot_watts / 1000, 2),
            kw_per_rack=round(rack_kw, 2),
            nodes_per_rack=self.nodes_per_rack,
            air_cooling_ok=rack_kw <= air_kw,
        )


def _fleet_size(
    point: OperatingPoint, par: Parallelism, request: PlanRequest, price: float
) -> _FleetSize:
    """Replicas for the peak at the target utilisation, plus spares, and what they cost."""
    w, fleet = request.workload, request.fleet
    for_peak = math.ceil(w.peak_rps / (point.requests_per_s * fleet.target_utilization))
    total = for_peak + fleet.redundancy
    per_hour = total * par.gpus * price
    tokens_per_hour = w.rps * (w.input_tokens + w.output_tokens) * 3600
    return _FleetSize(
        replicas=ReplicaCount(
            for_peak=for_peak,
            redundancy=fleet.redundancy,
            total=total,
            peak_rps=round(w.peak_rps, 4),
            utilization_at_peak=round(w.peak_rps / (for_peak * point.requests_per_s), 4),
        ),
        cost=CostReport(
            price_per_gpu_hour_usd=price,
            per_hour_usd=round(per_hour, 2),
            per_million_tokens_usd=round(per_hour / tokens_per_hour * 1e6, 4),
            per_million_output_tokens_usd=round(
                per_hour / (w.rps * w.output_tokens * 3600) * 1e6, 4
            ),
        ),
        nodes_per_rack=fleet.nodes_per_rack,
    )


_STATUS_ORDER = {"meets_slo": 0, "misses_slo": 1, "does_not_fit": 2}


def _rank_key(plan: GPUPlan) -> tuple[int, float, str]:
    cost = plan.cost.per_hour_usd if plan.cost is not None else math.inf
    return (_STATUS_ORDER[plan.status], cost, plan.gpu)


def plan(model: ModelSpec, gpus: list[GPUSpec], request: PlanRequest) -> PlanReport:
    """Plan ``model`` on each of ``gpus``; ``PlanError`` if it fits on none of them."""
    if not gpus:
        raise PlanError("give at least one GPU type")
    plans = sorted((plan_gpu(model, gpu, request) for gpu in gpus), key=_rank_key)
    if all(p.status == "does_not_fit" for p in plans):
        names = ", ".join(g.name for g in gpus)
        raise PlanError(
            f"{model.name} in {request.weights_dtype.value} fits on none of: {names} "
            f"(even {request.fleet.gpus_per_node} GPUs × {MAX_PIPELINE_STAGES} nodes)"
        )
    recommended = plans[0].gpu if plans[0].status == "meets_slo" else None
    notes = [
        "Latencies are the performance model's, without queueing: the pool is sized at "
        f"{request.fleet.target_utilization:.0%} utilisation to keep queues short; "
        "`gpufleet simulate` measures the rest on a trace.",
    ]
    if recommended is None:
        notes.append("No GPU type meets the SLO: relax it, quantise, or shorten the prompts.")
    return PlanReport(
        model=model.name,
        model_params_b=round(model.param_count() / 1e9, 2),
        model_active_params_b=round(model.active_param_count / 1e9, 2),
        weights_dtype=request.weights_dtype.value,
        kv_dtype=request.kv_dtype.value,
        workload=request.workload,
        slo=request.slo,
        fleet=request.fleet,
        recommended=recommended,
        plans=plans,
        notes=notes,
    )
