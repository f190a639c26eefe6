"""The human view of a plan: a ranked table, then the details of the best (or every) GPU type."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gpufleet.planner import BatchReport, GPUPlan, PlanReport

_STATUS = {
    "meets_slo": "[green]meets SLO[/]",
    "misses_slo": "[yellow]misses SLO[/]",
    "does_not_fit": "[red]does not fit[/]",
}


def _summary(report: PlanReport) -> Table:
    w, slo = report.workload, report.slo
    title = (
        f"{report.model} ({report.model_params_b:g}B, weights {report.weights_dtype}, "
        f"KV {report.kv_dtype}) · {w.rps:g} req/s × {w.peak_to_mean:g} peak · "
        f"{w.input_tokens}→{w.output_tokens} tokens"
    )
    slo_text = ", ".join(
        f"{label} ≤ {value:g} ms"
        for label, value in (
            ("TTFT p99", slo.ttft_p99_ms),
            ("TTFT p50", slo.ttft_p50_ms),
            ("TPOT p50", slo.tpot_p50_ms),
            ("TPOT p99", slo.tpot_p99_ms),
        )
        if value is not None
    )
    table = Table(title=title, caption=f"SLO: {slo_text}")
    columns = ("rank", "GPU", "TP×PP", "replicas", "GPUs", "$/hour", "$/M tok", "TTFT p99")
    for column in (*columns, "TPOT", "kW", "status"):
        table.add_column(column, justify="left" if column in ("GPU", "status") else "right")
    for rank, plan in enumerate(report.plans, start=1):
        table.add_row(str(rank), plan.gpu, *_summary_cells(plan), _STATUS[plan.status])
    return table


def _summary_cells(plan: GPUPlan) -> tuple[str, ...]:
    layout = f"{plan.tp}×{plan.pp}" if plan.tp is not None else "-"
    r, c, lat, p = plan.replicas, plan.cost, plan.latency, plan.power
    return (
        layout,
        f"{r.for_peak}+{r.redundancy}" if r else "-",
        str(plan.gpus_total) if plan.gpus_total is not None else "-",
        f"{c.per_hour_usd:,.2f}" if c else "-",
        f"{c.per_million_tokens_usd:.3f}" if c else "-",
        f"{lat.ttft_p99_ms:,.0f} ms" if lat else "-",
        f"{lat.tpot_p50_ms:.1f} ms" if lat else "-",
        f"{p.kw_fleet:,.1f}" if p else "-",
    )


def _details(plan: GPUPlan) -> Table:
    table = Table(title=f"{plan.gpu_display_name}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("status", f"{_STATUS[plan.status]}: {plan.reason}")
    m, kv, t = plan.memory, plan.kv, plan.throughput
    if m is not None and kv is not None and t is not None and plan.latency is not None:
        table.add_row(
            "memory per GPU",
            f"{m.total_gib:.1f} GiB: weights {m.weights_gib:.1f}, activations "
            f"{m.activation_gib:.1f}, overhead {m.overhead_gib:.1f}, KV cache {m.kv_cache_gib:.1f}",
        )
        layout = f"TP{plan.tp}×PP{plan.pp}; minimum {plan.min_gpus_per_replica}"
        table.add_row("GPUs per replica", f"{plan.gpus_per_replica} ({layout})")
        table.add_row(
            "KV cache",
            f"{kv.tokens:,} tokens ({kv.bytes_per_token:,} B/token) → concurrency "
            f"{kv.concurrency_at_mean_context} at {kv.mean_context:,}, "
            f"{kv.concurrency_at_p99_context} at {kv.p99_context:,}, "
            f"{kv.concurrency_at_max_model_len} at {kv.max_model_len:,} tokens",
        )
        table.add_row(
            "per replica",
            f"{t.requests_per_s:.2f} req/s, {t.output_tokens_per_s:,.0f} output tok/s at "
            f"concurrency {t.concurrency} ({t.bound}-bound)",
        )
        lat = plan.latency
        table.add_row(
            "latency",
            f"TTFT p50 {lat.ttft_p50_ms:,.0f} / p99 {lat.ttft_p99_ms:,.0f} ms; "
            f"TPOT p50 {lat.tpot_p50_ms:.1f} / p99 {lat.tpot_p99_ms:.1f} ms",
        )
    if plan.replicas is not None and plan.cost is not None and plan.power is not None:
        r, c, p = plan.replicas, plan.cost, plan.power
        table.add_row(
            "fleet",
            f"{r.for_peak} replicas for {r.peak_rps:g} req/s peak "
            f"({r.utilization_at_peak:.0%} busy) + {r.redundancy} spare = {plan.gpus_total} GPUs",
        )
        table.add_row(
            "cost",
            f"${c.per_hour_usd:,.2f}/hour at ${c.price_per_gpu_hour_usd:.2f}/GPU-hour; "
            f"${c.per_million_tokens_usd:.3f} per M tokens, "
            f"${c.per_million_output_tokens_usd:.3f} per M output tokens",
        )
        table.add_row(
            "power",
            f"{p.kw_per_replica:.1f} kW per replica, {p.kw_fleet:,.1f} kW fleet, "
            f"{p.kw_per_rack:.1f} kW per rack of {p.nodes_per_rack} nodes",
        )
    if plan.batch is not None:
        table.add_row("batch job", _batch_line(plan.batch))
    for candidate in plan.candidates:
        table.add_row(f"  TP{candidate.tp}×PP{candidate.pp}", candidate.note)
    for warning in plan.warnings:
        table.add_row("[yellow]warning[/]", warning)
    return table


def _batch_line(b: BatchReport) -> str:
    """``2,000,000 lines in 24 h: 1,878,746 on spare capacity; 121,254 (6.1 %) on 1 spot
    replica, $21.60 with ~1.2 preemptions, vs $72.00 on-demand (70 % less)``."""
    text = (
        f"{b.lines:,} lines in {b.window_hours:g} h at {b.lines_per_s_per_replica:.2f}/s per "
        f"replica: {b.spare_lines:,} on spare capacity"
    )
    if not b.spot_lines:
        return text + "; no GPU more"
    return text + (
        f"; {b.spot_lines:,} ({b.spot_share:.1%}) on {b.spot_replicas} spot "
        f"replica{'s' if b.spot_replicas != 1 else ''} at ${b.spot_price_per_gpu_hour_usd:.2f}"
        f"/GPU-h, ${b.spot_cost_usd:,.2f} with ~{b.expected_preemptions:g} preemptions "
        f"(~{b.expected_rerun_lines:,.0f} lines re-run), vs ${b.on_demand_cost_usd:,.2f} "
        f"on {b.on_demand_replicas} on-demand ({b.savings:.0%} less)"
    )


def render(report: PlanReport, *, details: bool, console: Console | None = None) -> None:
    out = console or Console()
    if not out.is_terminal:  # piped or captured: wide enough for the table, not 80 columns
        out.width = max(out.width, 132)
    out.print(_summary(report))
    shown = report.plans if details else report.plans[:1]
    for plan in shown:
        out.print(_details(plan))
    for note in report.notes:
        out.print(f"[dim]{note}[/]")
