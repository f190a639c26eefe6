"""``gpufleet plan --simulate``: the planner's candidates, each simulated on a trace; the
cheapest that holds the SLO is the answer (docs/planner.md, "Checked by simulation").

    trace ──► workload (rate, lengths, peak) ──► plan() ──► candidates: every GPU type ×
    every TP layout that fits × serving replicas 1 … the planner's count + 1 (where its
    model meets the SLO), and every count costing no more than the planner's own pick
          ──► run_sweep (processes, cheapest first, exact early stops) ──► the pick

Below the plain planner's pick's cost the search is exhaustive over the layouts that fit
(the model's verdict aside): that pick is always simulated, so nothing dearer can win when
it meets the SLO.

A candidate is written with ``serving + redundancy`` replicas (N+1, as the planner sizes
it) and simulated with ``serving``: the SLO must hold with the spares down. Costs are the
written fleet's, at the planner's prices.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from gpufleet.catalog import get_gpu
from gpufleet.cli._sweep_view import SweepBar, dump, result_row, status_text, sweep_table
from gpufleet.config import FleetConfig, load_fleet, parse_fleet
from gpufleet.planner import SLO, CandidateReport, GPUPlan, PlanReport, PlanRequest
from gpufleet.sim import (
    SimOptions,
    SLOTarget,
    SweepCandidate,
    SweepResult,
    SweepRun,
    SweepStatus,
    TraceRequest,
    TraceSpec,
    cheapest_met,
    run_sweep,
    write_pareto_plot,
)

PEAK_WINDOW_S = 60.0
"""The trace's peak rate is its busiest window of this many seconds."""


@dataclass(frozen=True, slots=True)
class TraceWorkload:
    """What the planner is told about the trace."""

    requests: int
    span_s: float
    workload: dict[str, Any]
    """``PlanRequest.workload``: mean rate, mean and p99 lengths, peak over mean."""


def trace_workload(requests: Iterable[TraceRequest]) -> TraceWorkload:
    """The trace's mean rate (requests ÷ last arrival), mean and lower-rank p99 lengths, and
    its peak: the busiest ``PEAK_WINDOW_S`` window's rate over the mean (at least 1)."""
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for r in requests:
        arrivals.append(r.arrival_s)
        inputs.append(r.input_tokens)
        outputs.append(r.output_tokens)
    n = len(arrivals)
    if n < 2 or arrivals[-1] <= 0:
        raise ValueError("the trace needs at least two requests at different times")
    span = arrivals[-1]
    window = min(PEAK_WINDOW_S, span)
    busiest, start = 0, 0
    for end, t in enumerate(arrivals):  # arrivals never go back: a sliding window
        while arrivals[start] < t - window:
            start += 1
        busiest = max(busiest, end - start + 1)
    mean = n / span

    def p99(values: list[int]) -> int:
        ordered = sorted(values)
        return max(ordered[math.floor(0.99 * (n - 1))], round(sum(values) / n))

    return TraceWorkload(
        requests=n,
        span_s=span,
        workload={
            "rps": mean,
            "input_tokens": max(1, round(sum(inputs) / n)),
            "output_tokens": max(1, round(sum(outputs) / n)),
            "input_p99_tokens": max(1, p99(inputs)),
            "output_p99_tokens": max(1, p99(outputs)),
            "peak_to_mean": max(1.0, busiest / window / mean),
        },
    )


def slo_target(slo: SLO, attainment: float | None) -> SLOTarget:
    """The planner's SLO as the simulator judges it; the per-request thresholds of
    attainment are the highest percentile's targets."""

    def s(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000

    return SLOTarget(
        ttft_p50_s=s(slo.ttft_p50_ms),
        ttft_p99_s=s(slo.ttft_p99_ms),
        tpot_p50_s=s(slo.tpot_p50_ms),
        tpot_p99_s=s(slo.tpot_p99_ms),
        ttft_s=s(slo.ttft_p99_ms or slo.ttft_p50_ms),
        tpot_s=s(slo.tpot_p99_ms or slo.tpot_p50_ms),
        attainment=attainment,
    )


@dataclass(frozen=True, slots=True)
class Option:
    """A candidate and what it is in the planner's terms."""

    candidate: SweepCandidate
    gpu: str
    tp: int
    serving: int
    replicas: int
    """Written: ``serving`` + the spares (an autoscaled pool: it starts with ``min``)."""
    autoscale: bool
    written: dict[str, Any]
    """The fleet file's content."""
    model_meets: bool
    """Whether the planner's model found the layout meeting the SLO (else it is here only
    because it costs no more than the planner's pick)."""


def template_of(path: Path) -> dict[str, Any]:
    """A fleet file whose one model gives the candidates their routing, health, start-up
    and gateway settings (validated first)."""
    fleet = load_fleet(path)
    if len(fleet.models) != 1:
        raise ValueError(
            f"--fleet {path}: a template has one model, this one has {len(fleet.models)}"
        )
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _fleet_data(
    template: Mapping[str, Any], model: str, gpu: str, tp: int, request: PlanRequest
) -> dict[str, Any]:
    data = copy.deepcopy(dict(template))
    entry = dict(data["models"][0])
    for key in ("model", "replicas", "autoscale", "args", "endpoints", "env", "ca_file"):
        entry.pop(key, None)
    engine = request.fleet
    entry.update(
        name=model,
        engine="sim",
        gpu=gpu,
        tp=tp,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        args=[
            f"--max-num-seqs={engine.max_num_seqs}",
            f"--max-num-batched-tokens={engine.max_num_batched_tokens}",
        ],
    )
    entry.pop("max_model_len", None)
    if engine.max_model_len is not None:
        entry["max_model_len"] = engine.max_model_len
    data["models"] = [entry]
    return data


def _with(data: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    out = copy.deepcopy(dict(data))
    out["models"][0].update(fields)
    return out


def _counts(
    layout: CandidateReport,
    plan: GPUPlan,
    request: PlanRequest,
    price: float,
    bound: float | None,
) -> list[int]:
    """Serving counts of one layout: 1 … the planner's count for the peak + 1 where its
    model meets the SLO, and every count whose fleet (spares included) costs no more than
    ``bound`` (the plain planner's pick), whatever the model says."""
    fleet = request.fleet
    counts: set[int] = set()
    if layout.meets_slo and layout.requests_per_s_per_gpu is not None:
        per_replica = layout.requests_per_s_per_gpu * layout.gpus
        for_peak = math.ceil(request.workload.peak_rps / (per_replica * fleet.target_utilization))
        if (plan.tp, plan.pp) == (layout.tp, layout.pp) and plan.replicas is not None:
            for_peak = max(for_peak, plan.replicas.for_peak)
        counts.update(range(1, for_peak + 2))
    if bound is not None:
        serving = 1
        while (serving + fleet.redundancy) * layout.gpus * price <= bound + 1e-9:
            counts.add(serving)
            serving += 1
    return sorted(counts)


def candidates_of(
    report: PlanReport,
    request: PlanRequest,
    template: Mapping[str, Any],
    *,
    autoscale: bool,
) -> tuple[list[Option], str | None, list[str]]:
    """Every candidate, the plain planner's pick among them (None: it has none), and notes
    on the layouts left out."""
    fleet = request.fleet
    spares = fleet.redundancy
    recommended = next((p for p in report.plans if p.gpu == report.recommended), None)
    bound = (
        None if recommended is None or recommended.cost is None else recommended.cost.per_hour_usd
    )
    options: list[Option] = []
    notes: list[str] = []
    planner_pick = None
    for plan in report.plans:
        price = fleet.prices.get(plan.gpu, get_gpu(plan.gpu).price_per_hour_usd)
        for layout in plan.candidates:
            if not layout.fits:
                continue
            if layout.pp > 1:
                notes.append(
                    f"{plan.gpu} TP{layout.tp}×PP{layout.pp}: left out, the fleet file has no "
                    "pipeline parallelism"
                )
                continue
            counts = _counts(layout, plan, request, price, bound)
            base = _fleet_data(template, report.model, plan.gpu, layout.tp, request)
            for serving in counts:
                name = f"{plan.gpu} TP{layout.tp} {serving}+{spares}"
                keep = (
                    plan is recommended
                    and (plan.tp, plan.pp) == (layout.tp, layout.pp)
                    and plan.replicas is not None
                    and serving == plan.replicas.for_peak
                )
                total = serving + spares
                candidate = SweepCandidate(
                    name,
                    parse_fleet(_with(base, replicas=serving), source=name),
                    round(total * layout.gpus * price, 4),
                    keep=keep,
                )
                options.append(
                    Option(
                        candidate,
                        plan.gpu,
                        layout.tp,
                        serving,
                        total,
                        autoscale=False,
                        written=_with(base, replicas=total),
                        model_meets=layout.meets_slo,
                    )
                )
                if keep:
                    planner_pick = name
            top = max(counts, default=0) + spares
            if autoscale and layout.meets_slo and top >= 2:
                options.append(_autoscaled(plan.gpu, layout, base, top, price))
    return options, planner_pick, notes


def _autoscaled(
    gpu: str, layout: CandidateReport, base: Mapping[str, Any], top: int, price: float
) -> Option:
    """One layout autoscaled from 2 (N+1) to ``top`` replicas; ordered by its floor's cost."""
    scaled = _with(base, replicas=2, autoscale={"min_replicas": 2, "max_replicas": top})
    name = f"{gpu} TP{layout.tp} autoscale 2-{top}"
    return Option(
        SweepCandidate(
            name, parse_fleet(scaled, source=name), round(2 * layout.gpus * price, 4), exact=False
        ),
        gpu,
        layout.tp,
        2,
        2,
        autoscale=True,
        written=scaled,
        model_meets=True,
    )


@dataclass(frozen=True, slots=True)
class PlanSimulation:
    """``plan --simulate``'s inputs beyond the plan request."""

    trace: TraceSpec
    trace_label: str
    requests: int
    span_s: float
    template: dict[str, Any]
    jobs: int
    attainment: float | None
    autoscale: bool
    prune: bool
    out: Path
    plots: bool


def simulate_plan(
    report: PlanReport, request: PlanRequest, setup: PlanSimulation, console: Console
) -> None:
    """Simulate the candidates, print the table, write the JSON, the plot and the winner."""
    slo = slo_target(request.slo, setup.attainment)
    options, planner_pick, notes = candidates_of(
        report, request, setup.template, autoscale=setup.autoscale
    )
    if not options:
        raise ValueError(
            f"no layout of {report.model} meets the SLO in the planner's model on "
            f"{', '.join(p.gpu for p in report.plans)}: nothing to simulate"
        )
    sim_options = SimOptions(seed=setup.trace.seed, ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s)
    run = SweepRun(
        setup.trace,
        sim_options,
        slo,
        setup.requests,
        setup.span_s,
        prune=setup.prune,
        prices=request.fleet.prices,
    )
    setup.out.mkdir(parents=True, exist_ok=True)
    candidates = [o.candidate for o in options]
    console.print(
        f"simulating up to {len(candidates)} candidates of {report.model} on "
        f"{setup.trace_label} ({setup.requests:,} requests, {setup.span_s:,.0f} s) in "
        f"{setup.jobs} process{'es' if setup.jobs > 1 else ''}",
        highlight=False,
    )
    wall = time.perf_counter()
    with SweepBar(console, candidates, setup.span_s) as bar:
        results = run_sweep(candidates, run, jobs=setup.jobs, progress=bar)
    wall = time.perf_counter() - wall
    best = cheapest_met(results)
    by_name = {r.name: r for r in results}
    verdict = _planner_verdict(by_name.get(planner_pick or ""), best)
    marks = {planner_pick: "planner's pick"} if planner_pick else {}
    console.print(
        sweep_table(
            results,
            {
                "GPU": [o.gpu for o in options],
                "TP": [str(o.tp) for o in options],
                "replicas": [
                    f"{o.serving}+{o.replicas - o.serving}" if not o.autoscale else "auto"
                    for o in options
                ],
            },
            picked=None if best is None else best.name,
            marks=marks,
            title=f"{report.model} on {setup.trace_label}: {_slo_text(slo)}",
        )
    )
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    winner = None if best is None else options[[o.candidate.name for o in options].index(best.name)]
    if winner is None:
        console.print("[bold red]no candidate met the SLO[/]: relax it, or add GPU types")
    else:
        fleet_path = setup.out / "fleet.yaml"
        write_fleet(fleet_path, winner, best, setup.trace_label)
        console.print(
            f"pick: [bold]{winner.candidate.name}[/] (${winner.candidate.usd_per_hour:,.2f}/h"
            f"{'' if winner.candidate.exact else ', as charged'}), written to {fleet_path}",
            highlight=False,
        )
    if verdict is not None:
        console.print(f"the plain planner's pick, {planner_pick}: {verdict}", highlight=False)
    counts = {s.value: sum(r.status is s for r in results) for s in SweepStatus}
    ran = sum(r.ran for r in results)
    console.print(
        f"{len(results)} candidates: {ran} simulated to the end, "
        + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        + f"; {wall:.1f} s wall",
        highlight=False,
    )
    dump(
        setup.out / "plan-simulate.json",
        {
            "inputs": {
                "trace": setup.trace_label,
                "format": None if setup.trace.format is None else setup.trace.format.value,
                "rate_scale": setup.trace.rate_scale,
                "duration": setup.trace.duration,
                "seed": setup.trace.seed,
                "requests": setup.requests,
                "span_s": round(setup.span_s, 6),
                "jobs": setup.jobs,
                "prune": setup.prune,
                "autoscale": setup.autoscale,
            },
            "slo": {k: getattr(slo, k) for k in SLOTarget.__dataclass_fields__},
            "plan": report.model_dump(mode="json"),
            "pick": None if best is None else best.name,
            "planner_pick": planner_pick,
            "planner_pick_verdict": verdict,
            "candidates": [
                {
                    "gpu": o.gpu,
                    "tp": o.tp,
                    "serving": o.serving,
                    "replicas": o.replicas,
                    "autoscale": o.autoscale,
                    "model_meets_slo": o.model_meets,
                    **result_row(r),
                }
                for o, r in zip(options, results, strict=True)
            ],
            "notes": notes,
            "wall_s": round(wall, 3),
        },
    )
    if setup.plots:
        write_pareto_plot(
            setup.out / "pareto.png",
            results,
            slo,
            picked=None if best is None else best.name,
            marked=None if planner_pick is None else (planner_pick, "planner"),
            title=f"{report.model}: cost against P99 ({setup.trace_label})",
        )
    console.print(f"wrote {setup.out}/", highlight=False)


def _slo_text(slo: SLOTarget) -> str:
    parts = [f"{label} ≤ {limit * 1000:g} ms" for label, _, _, limit in slo.terms()]
    if slo.attainment is not None:
        parts.append(f"attainment ≥ {slo.attainment:.1%}")
    return ", ".join(parts)


def _planner_verdict(planned: SweepResult | None, best: SweepResult | None) -> str | None:
    """How far the plain planner's pick was off (None: it has none, or it is the pick)."""
    if planned is None or (best is not None and planned.name == best.name):
        return None
    if planned.status is SweepStatus.MISSED:
        return "misses the SLO in simulation: " + "; ".join(planned.reasons)
    if best is None:
        return status_text(planned)
    extra = planned.usd_per_hour - best.usd_per_hour
    if extra <= 0:
        return f"meets the SLO at the same cost (${planned.usd_per_hour:,.2f}/h)"
    return (
        f"meets the SLO in simulation at ${planned.usd_per_hour:,.2f}/h, "
        f"${extra:,.2f}/h ({extra / best.usd_per_hour:.0%}) more than the pick"
    )


def write_fleet(path: Path, winner: Option, result: SweepResult | None, trace: str) -> FleetConfig:
    """The winning fleet file (YAML ``load_fleet`` reads), with where it came from."""
    lines = [
        f"# The cheapest fleet that met the SLO on {trace}, found by `gpufleet plan --simulate`.",
    ]
    if result is not None and result.overall is not None:
        o = result.overall
        lines.append(
            f"# Simulated with {winner.serving} replicas serving: TTFT p50 / p99 "
            f"{o['ttft_s']['p50']} / {o['ttft_s']['p99']} s, TPOT p50 / p99 "
            f"{o['tpot_s']['p50']} / {o['tpot_s']['p99']} s; ${result.usd_per_hour:,.2f}/h."
        )
    if not winner.autoscale and winner.replicas > winner.serving:
        lines.append(
            f"# replicas: {winner.serving} + {winner.replicas - winner.serving} spare(s) (N+1): "
            "the SLO held with the spares down."
        )
    text = "\n".join(lines) + "\n" + yaml.safe_dump(winner.written, sort_keys=False)
    path.write_text(text)
    return parse_fleet(winner.written, source=str(path))
