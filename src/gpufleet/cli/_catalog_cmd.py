"""``gpufleet catalog``: the GPUs and models the planner and simulator know."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from gpufleet.catalog import load_gpus, load_models

app = typer.Typer(help="List the packaged GPU and model catalog.", no_args_is_help=True)


@app.command("gpus")
def gpus() -> None:
    """GPU types with memory, bandwidth, dense throughput, links, power and price."""
    table = Table(title="GPUs (dense throughput)")
    for column in ("name", "GiB", "GB/s", "BF16 TF", "FP8 TF", "link", "W", "$/h"):
        table.add_column(column, justify="left" if column in ("name", "link") else "right")
    for gpu in load_gpus().values():
        link = gpu.interconnect
        link_text = (
            f"{link.kind.value} {link.gpu_link_gb_s:.0f} GB/s"
            if link.gpu_link_gb_s
            else f"pcie {link.pcie_gb_s:.0f} GB/s"
        )
        table.add_row(
            gpu.name,
            f"{gpu.memory_gib:.0f}",
            f"{gpu.memory_bandwidth_gb_s:.0f}",
            f"{gpu.bf16_tflops:.0f}",
            f"{gpu.fp8_tflops:.0f}" if gpu.fp8_tflops else "-",
            link_text,
            f"{gpu.tdp_watts:.0f}",
            f"{gpu.price_per_hour_usd:.2f}",
        )
    Console().print(table)


@app.command("models")
def models() -> None:
    """Models with their shapes and parameter counts."""
    table = Table(title="Models")
    for column in ("name", "params (B)", "layers", "hidden", "heads/kv", "experts", "context"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for model in load_models().values():
        experts = f"{model.experts_per_token}/{model.num_experts}" if model.is_moe else "-"
        table.add_row(
            model.name,
            f"{model.param_count() / 1e9:.2f}",
            str(model.num_layers),
            str(model.hidden_size),
            f"{model.num_attention_heads}/{model.num_kv_heads}",
            experts,
            str(model.max_context),
        )
    Console().print(table)
