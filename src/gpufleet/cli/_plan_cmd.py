"""``gpufleet plan``: size a fleet for a model, a workload and SLOs on one or more GPU types."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console

from gpufleet.catalog import get_gpu, get_model
from gpufleet.cli._errors import user_errors
from gpufleet.cli._plan_simulate import PlanSimulation, simulate_plan, template_of, trace_workload
from gpufleet.cli._plan_view import render
from gpufleet.config import DEFAULT_FLEET, load_fleet
from gpufleet.perf import Dtype, parse_dtype
from gpufleet.planner import PlanReport, PlanRequest
from gpufleet.planner import plan as make_plan
from gpufleet.sim import SAMPLE_TRACE, TraceFormat, TraceSpec

DEFAULT_GPUS = "h100-sxm,h200,a100-80gb-sxm,l40s"

_FLAGS = {  # pydantic field → the flag a user typed, for error messages
    "workload.rps": "--rps",
    "workload.input_tokens": "--input-tokens",
    "workload.output_tokens": "--output-tokens",
    "workload.input_p99_tokens": "--input-p99-tokens",
    "workload.output_p99_tokens": "--output-p99-tokens",
    "workload.peak_to_mean": "--peak-to-mean",
    "slo.ttft_p99_ms": "--ttft-p99-ms",
    "slo.ttft_p50_ms": "--ttft-p50-ms",
    "slo.tpot_p50_ms": "--tpot-ms",
    "slo.tpot_p99_ms": "--tpot-p99-ms",
    "fleet.target_utilization": "--target-utilization",
    "fleet.redundancy": "--redundancy",
    "fleet.gpu_memory_utilization": "--gpu-memory-utilization",
    "fleet.max_num_seqs": "--max-num-seqs",
    "fleet.max_num_batched_tokens": "--max-num-batched-tokens",
    "fleet.max_model_len": "--max-model-len",
    "fleet.nodes_per_rack": "--nodes-per-rack",
    "fleet.gpus_per_node": "--gpus-per-node",
    "fleet.prices": "--price",
    "batch.lines": "--batch-lines",
    "batch.input_tokens": "--batch-input-tokens",
    "batch.output_tokens": "--batch-output-tokens",
    "batch.window_hours": "--batch-window-hours",
    "batch.spare_target": "--spare-target",
    "batch.spot_discount": "--spot-discount",
    "batch.preemptions_per_gpu_hour": "--preemptions-per-gpu-hour",
}
_BATCH: Final = "Batch and spot"

_WORKLOAD_FLAGS = (  # parameter → flag: with --simulate, the trace is the workload
    ("rps", "--rps"),
    ("tokens_per_s", "--tokens-per-s"),
    ("input_tokens", "--input-tokens"),
    ("output_tokens", "--output-tokens"),
    ("input_p99_tokens", "--input-p99-tokens"),
    ("output_p99_tokens", "--output-p99-tokens"),
    ("peak_to_mean", "--peak-to-mean"),
)


def _rename(message: str) -> str:
    for field, flag in _FLAGS.items():
        if message.startswith(field + ":"):
            return flag + message[len(field) :]
    return message


def _prices(items: list[str]) -> dict[str, float]:
    prices: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--price expects GPU=USD_PER_HOUR, got {item!r}")
        key = get_gpu(name).name
        try:
            prices[key] = float(value)
        except ValueError:
            raise ValueError(f"--price {item!r}: {value!r} is not a number") from None
    return prices


def plan(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Catalog model name or a config.json path.")] = (
        "llama-3.1-8b"
    ),
    gpu: Annotated[str, typer.Option(help="GPU types to compare, comma-separated.")] = (
        DEFAULT_GPUS
    ),
    weights_dtype: Annotated[str, typer.Option(help="fp32, bf16, fp16, fp8, int8, int4.")] = (
        "bf16"
    ),
    kv_dtype: Annotated[str, typer.Option(help="KV cache: bf16, fp16 or fp8.")] = "bf16",
    rps: Annotated[float | None, typer.Option(help="Mean requests per second.")] = None,
    tokens_per_s: Annotated[
        float | None, typer.Option(help="Mean total tokens per second (instead of --rps).")
    ] = None,
    input_tokens: Annotated[int, typer.Option(help="Mean prompt length.")] = 1024,
    output_tokens: Annotated[int, typer.Option(help="Mean output length.")] = 256,
    input_p99_tokens: Annotated[int | None, typer.Option(help="P99 prompt length.")] = None,
    output_p99_tokens: Annotated[int | None, typer.Option(help="P99 output length.")] = None,
    peak_to_mean: Annotated[float, typer.Option(help="Peak rate over mean rate.")] = 1.0,
    ttft_p99_ms: Annotated[float | None, typer.Option(help="TTFT target at P99.")] = 2000.0,
    ttft_p50_ms: Annotated[float | None, typer.Option(help="TTFT target at P50.")] = None,
    tpot_ms: Annotated[float | None, typer.Option(help="Time per output token, P50.")] = 50.0,
    tpot_p99_ms: Annotated[float | None, typer.Option(help="Time per output token, P99.")] = None,
    target_utilization: Annotated[float, typer.Option(help="Scale-out utilisation.")] = 0.65,
    redundancy: Annotated[int, typer.Option(help="Spare replicas per pool (N+k).")] = 1,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's setting.")] = 0.9,
    max_num_seqs: Annotated[int, typer.Option(help="vLLM's running-batch cap.")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="vLLM's token budget.")] = 8192,
    max_model_len: Annotated[int | None, typer.Option(help="Longest context served.")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs in one server.")] = 8,
    nodes_per_rack: Annotated[int, typer.Option(help="Servers in one rack.")] = 4,
    price: Annotated[
        list[str] | None, typer.Option(help="GPU=USD per GPU-hour (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    json_schema: Annotated[
        bool, typer.Option("--json-schema", help="Print the JSON schema of --json and exit.")
    ] = False,
    details: Annotated[bool, typer.Option(help="Detail every GPU type, not just the best.")] = (
        False
    ),
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Simulate the planner's candidates on a trace and pick the cheapest that "
            "meets the SLO (docs/planner.md).",
            rich_help_panel="Checked by simulation",
        ),
    ] = False,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="With --simulate: the trace, also the workload (default: the packaged Azure "
            "2023 conversation hour).",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="The trace's format (detected): azure, mooncake, burstgpt, jsonl, recording.",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    rate_scale: Annotated[
        float,
        typer.Option(
            help="Replay the trace this many times faster.", rich_help_panel="Checked by simulation"
        ),
    ] = 1.0,
    duration: Annotated[
        float | None,
        typer.Option(
            help="Only the trace's first S (scaled) seconds.",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    fleet: Annotated[
        Path | None,
        typer.Option(
            help="A one-model fleet file whose routing, health, start-up and gateway the "
            "candidates take (default: the packaged default fleet).",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    attainment: Annotated[
        float | None,
        typer.Option(
            help="Least share of requests within the TTFT and TPOT targets (default: not judged).",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    autoscale: Annotated[
        bool,
        typer.Option(
            "--autoscale",
            help="Add an autoscaled candidate per layout (min 2 replicas).",
            rich_help_panel="Checked by simulation",
        ),
    ] = False,
    prune: Annotated[
        bool,
        typer.Option(
            help="Stop candidates early (exact rules).", rich_help_panel="Checked by simulation"
        ),
    ] = True,
    jobs: Annotated[
        int | None,
        typer.Option(
            help="Processes (default: the CPU count).", rich_help_panel="Checked by simulation"
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="The runs' seed (default: the fleet's gateway.seed).",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="With --simulate: where plan-simulate.json, pareto.png and fleet.yaml go.",
            rich_help_panel="Checked by simulation",
        ),
    ] = None,
    plots: Annotated[
        bool, typer.Option(help="Draw pareto.png.", rich_help_panel="Checked by simulation")
    ] = True,
    batch_lines: Annotated[
        int | None,
        typer.Option(
            help="A batch job of this many lines: run on spare capacity, the rest on spot.",
            rich_help_panel=_BATCH,
        ),
    ] = None,
    batch_input_tokens: Annotated[
        int | None,
        typer.Option(
            help="A line's mean prompt (default: --input-tokens).", rich_help_panel=_BATCH
        ),
    ] = None,
    batch_output_tokens: Annotated[
        int | None,
        typer.Option(
            help="A line's mean output (default: --output-tokens).", rich_help_panel=_BATCH
        ),
    ] = None,
    batch_window_hours: Annotated[
        float, typer.Option(help="The job's completion window.", rich_help_panel=_BATCH)
    ] = 24.0,
    spare_target: Annotated[
        float,
        typer.Option(help="Share of the fleet batch lines may fill.", rich_help_panel=_BATCH),
    ] = 0.8,
    spot_discount: Annotated[
        float, typer.Option(help="Spot's price below on-demand.", rich_help_panel=_BATCH)
    ] = 0.7,
    preemptions_per_gpu_hour: Annotated[
        float, typer.Option(help="Spot preemptions per GPU-hour.", rich_help_panel=_BATCH)
    ] = 0.05,
) -> None:
    """Plan a fleet: memory, parallelism, KV capacity, replicas, cost and power per GPU type.

    Example: gpufleet plan --model llama-3.1-70b --gpu h100-sxm,a100-80gb-sxm
    --weights-dtype fp8 --rps 20 --input-tokens 1000 --output-tokens 200
    --ttft-p99-ms 500 --tpot-ms 50
    """
    if json_schema:
        typer.echo(json.dumps(PlanReport.model_json_schema(), indent=2))
        return
    with user_errors(_rename):
        setup, trace_load = None, None
        if simulate:
            _simulate_checks(ctx, weights_dtype, kv_dtype)
            setup, trace_load = _simulation(
                trace, fmt, rate_scale, duration, fleet, seed, jobs, attainment, autoscale,
                prune, out, plots,
            )  # fmt: skip
            rps = trace_load["rps"]
        elif trace is not None or out is not None or fleet is not None:
            raise ValueError("--trace, --fleet and --out go with --simulate")
        if rps is not None and tokens_per_s is not None:
            raise ValueError("give --rps or --tokens-per-s, not both")
        spec = get_model(model)
        gpus = [get_gpu(name) for name in gpu.split(",") if name.strip()]
        if not gpus:
            raise ValueError("--gpu names no GPU")
        if tokens_per_s is not None and tokens_per_s <= 0:
            raise ValueError(f"--tokens-per-s must be positive, got {tokens_per_s}")
        mean_rps = 10.0 if rps is None else rps
        if tokens_per_s is not None:
            mean_rps = tokens_per_s / max(1, input_tokens + output_tokens)
        request = PlanRequest.model_validate(
            {
                "weights_dtype": parse_dtype(weights_dtype),
                "kv_dtype": parse_dtype(kv_dtype, kv=True),
                "workload": trace_load
                or {
                    "rps": mean_rps,
                    "input_tokens": input_tokens,
                    "output_tokens": output_tokens,
                    "input_p99_tokens": input_p99_tokens,
                    "output_p99_tokens": output_p99_tokens,
                    "peak_to_mean": peak_to_mean,
                },
                "slo": {
                    "ttft_p99_ms": ttft_p99_ms,
                    "ttft_p50_ms": ttft_p50_ms,
                    "tpot_p50_ms": tpot_ms,
                    "tpot_p99_ms": tpot_p99_ms,
                },
                "batch": None
                if batch_lines is None
                else {
                    "lines": batch_lines,
                    "input_tokens": batch_input_tokens,
                    "output_tokens": batch_output_tokens,
                    "window_hours": batch_window_hours,
                    "spare_target": spare_target,
                    "spot_discount": spot_discount,
                    "preemptions_per_gpu_hour": preemptions_per_gpu_hour,
                },
                "fleet": {
                    "target_utilization": target_utilization,
                    "redundancy": redundancy,
                    "gpu_memory_utilization": gpu_memory_utilization,
                    "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    "max_model_len": max_model_len,
                    "gpus_per_node": gpus_per_node,
                    "nodes_per_rack": nodes_per_rack,
                    "prices": _prices(price or []),
                },
            }
        )
        report = make_plan(spec, gpus, request)
        if setup is not None:
            console = Console(highlight=False)
            if not console.is_terminal:  # piped or captured: wide enough for the table
                console.width = max(console.width, 160)
            simulate_plan(report, request, setup, console)
            return
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render(report, details=details)


def _simulate_checks(ctx: typer.Context, weights_dtype: str, kv_dtype: str) -> None:
    """What --simulate refuses: workload flags (the trace is the workload), other dtypes."""
    for name, flag in _WORKLOAD_FLAGS:
        source = ctx.get_parameter_source(name)  # typer carries its own click: by name
        if source is not None and source.name == "COMMANDLINE":
            raise ValueError(
                f"{flag}: with --simulate the trace is the workload "
                "(--rate-scale and --duration change it)"
            )
    dtypes = {parse_dtype(weights_dtype), parse_dtype(kv_dtype, kv=True)}
    if dtypes != {Dtype.BF16}:
        raise ValueError(
            "--simulate models bf16 weights and KV cache (a fleet file names no dtype)"
        )


def _simulation(
    trace: Path | None,
    fmt: str | None,
    rate_scale: float,
    duration: float | None,
    fleet: Path | None,
    seed: int | None,
    jobs: int | None,
    attainment: float | None,
    autoscale: bool,
    prune: bool,
    out: Path | None,
    plots: bool,
) -> tuple[PlanSimulation, dict[str, Any]]:
    """``--simulate``'s setup, checked before anything runs, and the trace's workload."""
    if out is None:
        raise ValueError("--simulate needs --out (a directory for its files)")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    if attainment is not None and not 0 < attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {attainment}")
    template_path = fleet if fleet is not None else DEFAULT_FLEET
    template = template_of(template_path)
    run_seed = seed if seed is not None else load_fleet(template_path).gateway.seed
    label = str(trace) if trace is not None else "the Azure 2023 conversation hour"
    path = trace if trace is not None else SAMPLE_TRACE
    if not path.exists():
        raise ValueError(f"{path}: no such trace file")
    spec = TraceSpec(
        path,
        TraceFormat(fmt) if fmt is not None else None,
        rate_scale=rate_scale,
        duration=duration,
        seed=run_seed,
    )
    found = trace_workload(spec.open())
    setup = PlanSimulation(
        trace=spec,
        trace_label=label,
        requests=found.requests,
        span_s=found.span_s,
        template=template,
        jobs=jobs if jobs is not None else os.cpu_count() or 1,
        attainment=attainment,
        autoscale=autoscale,
        prune=prune,
        out=out,
        plots=plots,
    )
    return setup, found.workload
