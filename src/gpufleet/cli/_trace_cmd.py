"""``gpufleet trace synth``: write a day of diurnal load as a gpufleet JSONL trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gpufleet.cli._errors import user_errors
from gpufleet.sim import SAMPLE_TRACE, DiurnalCurve, load_trace, synth_requests

app = typer.Typer(help="Make request traces.", no_args_is_help=True)
_PACKAGED = "the packaged Azure 2023 conversation trace"


@app.command()
def synth(
    out: Annotated[Path, typer.Option(help="The JSONL trace to write.")],
    seed: Annotated[int, typer.Option(help="Seed of every draw (arrivals and sizes).")] = 0,
    hours: Annotated[float, typer.Option(help="Length of the trace, from midnight.")] = 24.0,
    peak_rps: Annotated[
        float, typer.Option(help="The day's highest rate, spikes included (requests/s).")
    ] = 8.0,
    trough: Annotated[
        float, typer.Option(help="The diurnal curve's lowest rate as a share of its highest.")
    ] = 0.2,
    trough_hour: Annotated[float, typer.Option(help="Hour of the lowest rate.")] = 4.0,
    no_spikes: Annotated[
        bool, typer.Option("--no-spikes", help="The diurnal curve alone.")
    ] = False,
    sizes: Annotated[
        Path,
        typer.Option(
            help="A trace whose prompt and output lengths are drawn (default: the packaged "
            "Azure 2023 conversation hour).",
            show_default=False,
        ),
    ] = SAMPLE_TRACE,
) -> None:
    """A day-long diurnal trace (docs/traces.md): Poisson arrivals along a raised cosine
    with spikes, prompt and output lengths drawn from a real trace.

    Example: gpufleet trace synth --out runs/diurnal.jsonl --seed 0 --peak-rps 8
    """
    with user_errors():
        curve = DiurnalCurve(
            peak_rps=peak_rps,
            hours=hours,
            trough=trough,
            trough_h=trough_hour,
            **({"spikes": ()} if no_spikes else {}),
        )
        try:
            pairs = [(r.input_tokens, r.output_tokens) for r in load_trace(sizes)]
        except FileNotFoundError:
            raise ValueError(f"{sizes}: no such trace file (pass --sizes)") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        count = 0
        with out.open("w", encoding="utf-8") as file:
            for request in synth_requests(curve, pairs, seed=seed):
                file.write(
                    json.dumps(
                        {
                            "arrival_s": request.arrival_s,
                            "input_tokens": request.input_tokens,
                            "output_tokens": request.output_tokens,
                        }
                    )
                    + "\n"
                )
                count += 1
    typer.echo(
        f"wrote {out}: {count:,} requests over {hours:g} h "
        f"(mean {count / (hours * 3600):.2f} req/s, peak {peak_rps:g} req/s), seed {seed}, "
        f"sizes from {_PACKAGED if sizes == SAMPLE_TRACE else sizes.name}"
    )
