"""``gpufleet plan``: size a fleet for a model, a workload and SLOs on one or more GPU types."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from gpufleet.catalog import get_gpu, get_model
from gpufleet.cli._errors import user_errors
from gpufleet.cli._plan_view import render
from gpufleet.perf import parse_dtype
from gpufleet.planner import PlanReport, PlanRequest
from gpufleet.planner import plan as make_plan

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
}


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
                "workload": {
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
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
    else:
        render(report, details=details)
