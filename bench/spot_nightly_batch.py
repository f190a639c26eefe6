"""A diurnal day plus a nightly batch on a spot pool, against the same batch on on-demand.

    .venv/bin/python bench/spot_nightly_batch.py                  # the bar: 24 h, 200,000 lines
    .venv/bin/python bench/spot_nightly_batch.py --hours 4 --lines 20000   # a quick look
    .venv/bin/python bench/spot_nightly_batch.py --short 1,3 --preemptions 0.5
        # no spot GPU to be had from 01:00 to 03:00: a third run with `spot.fallback:
        # on_demand` beside the default (`wait`)

Issue 17's bar, simulated (docs/spot.md):

1. the day: ``synth_requests(DiurnalCurve(peak_rps), Azure 2023 conversation sizes, seed)``
   on ``examples/diurnal-autoscale.yaml``'s pool (Llama-3.1-70B, TP2 on H100, autoscaled),
   judged by TTFT ≤ 1 s and mean inter-token latency ≤ 60 ms per request;
2. the batch: ``--lines`` lines submitted at midnight (``BatchJob``) to a second pool of
   the same replicas, autoscaled between 0 and ``--batch-replicas``, with ``--window``
   hours to finish (before the morning rush);
3. two runs in parallel processes: the batch pool ``capacity: spot`` with preemptions
   (``spot`` fault: ``--preemptions`` per GPU-hour, ``--notice`` seconds of notice, a
   replacement after the pool's cold start), and the same pool ``on_demand``;
4. a table (batch completion and its window, interactive SLO attainment, GPU-hours split,
   cost), ``bench/results/spot_nightly_batch.json`` and ``.png`` (replicas over the day).

The bar: the batch completes within its window, interactive attainment ≥ 99 %, and the
cost against running the same batch on on-demand.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpufleet.config import load_fleet, parse_fleet
from gpufleet.sim import (
    BatchJob,
    DiurnalCurve,
    FleetSimulation,
    SimOptions,
    SpotFault,
    SpotOutageFault,
    load_trace,
    synth_requests,
)

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
RESULT = ROOT / "bench" / "results" / "spot_nightly_batch.json"
PLOT = ROOT / "bench" / "results" / "spot_nightly_batch.png"
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.060
INTERACTIVE = "llama-3.1-70b"
BATCH = "llama-3.1-70b-batch"


def fleet_of(capacity: str, batch_replicas: int, fallback: str = "wait") -> Any:
    """The autoscaling example's fleet plus the batch pool (``capacity``)."""
    day = load_fleet(ROOT / "examples" / "diurnal-autoscale.yaml").model_dump(
        mode="json", exclude_unset=True
    )
    interactive = day["models"][0]
    batch = {
        "name": BATCH,
        "model": "llama-3.1-70b",
        "engine": "sim",
        "gpu": interactive["gpu"],
        "tp": interactive["tp"],
        "replicas": batch_replicas,
        "routing": "least_request",
        "startup": interactive["startup"],
        "capacity": capacity,
        **({"spot": {"fallback": fallback}} if capacity == "spot" else {}),
        # the pool exists for the job: up for it, down to zero after it (no prewarm)
        "autoscale": {"min_replicas": 0, "scale_to_zero": True, "max_replicas": batch_replicas,
                      "target_utilisation": 0.5, "scale_down_cooldown": 300},
    }  # fmt: skip
    day["models"] = [interactive, batch]
    return parse_fleet(day, source=f"{capacity} fleet")


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    capacity, _, fallback = name.partition("+")
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(AZURE)]
    curve = DiurnalCurve(peak_rps=args.peak_rps, hours=args.hours)
    trace = synth_requests(curve, sizes, seed=args.seed)
    job = BatchJob(args.lines, at=0.0, model=BATCH, window_s=args.window * 3600.0)
    spot = SpotFault(per_gpu_hour=args.preemptions, notice_s=args.notice, startup_s=420.0)
    faults: list[Any] = [spot]
    if args.short:
        start, end = (float(h) * 3600.0 for h in args.short.split(","))
        faults.append(SpotOutageFault.model_validate({"from": start, "to": end}))
    options = SimOptions(
        seed=0,
        sample_interval=60.0,
        ttft_slo_s=TTFT_SLO_S,
        tpot_slo_s=TPOT_SLO_S,
        faults=tuple(faults),
        batch=job,
    )
    fleet = fleet_of(capacity, args.batch_replicas, fallback or "wait")
    sim = FleetSimulation(fleet, options)
    sim.start(trace)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    if problems:
        raise RuntimeError(f"{name}: {problems}")
    report = sim.report({"hours": args.hours, "peak_rps": args.peak_rps, "seed": args.seed})
    return {"name": name, "wall_s": round(wall, 1), "report": report}


def summary(report: dict[str, Any]) -> dict[str, Any]:
    interactive = report["models"][INTERACTIVE]
    cost = report["cost"]
    batch = report["batch"]
    pools = cost["models"]
    return {
        "batch": {k: batch[k] for k in ("lines", "completed", "failed", "took_s", "within_window")},
        "batch_window_s": batch["window_s"],
        "interactive_requests": interactive["requests"],
        "interactive_failed": interactive["failed"],
        "interactive_slo_attainment": interactive["slo"]["attainment"],
        "interactive_ttft_p99_s": interactive["ttft_s"]["p99"],
        "preemptions": report["faults"]["preemptions"],
        "on_demand_stand_ins": report["faults"]["on_demand_stand_ins"],
        "batch_lines_retried": report["faults"]["free_retries"],
        "gpu_hours": {name: pools[name]["gpu_hours"] for name in (INTERACTIVE, BATCH)},
        "usd": {name: pools[name]["usd"] for name in (INTERACTIVE, BATCH)},
        "usd_per_gpu_hour": {name: pools[name]["usd_per_gpu_hour"] for name in pools},
        "by_capacity": cost["by_capacity"],
        "total_usd": cost["usd"],
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), sharex=True,
                             layout="constrained")  # fmt: skip
    for ax, run in zip(axes, runs, strict=True):
        timeline = run["report"]["timeline"]
        t = [x / 3600 for x in timeline["t"]]
        for pool, phases in timeline["phases"].items():
            ax.step(t, phases["serving"], where="post", label=f"{pool} serving", linewidth=1.2)
        ax.step(t, timeline["gpus"], where="post", color="0.6", linewidth=0.8,
                label="GPUs charged, both pools")  # fmt: skip
        batch = run["report"]["batch"]
        if batch["finished_s"] is not None:
            ax.axvline(batch["finished_s"] / 3600, color="k", linestyle=":", linewidth=1)
        ax.set_ylabel("replicas, GPUs")
        ax.set_title(f"batch pool {run['name']}: replicas serving (dotted: the batch's end)")
        ax.legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("hour of the day")
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--peak-rps", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--window", type=float, default=8.0, help="hours the batch has")
    parser.add_argument("--batch-replicas", type=int, default=6)
    parser.add_argument("--preemptions", type=float, default=0.05, help="per GPU-hour")
    parser.add_argument("--notice", type=float, default=60.0, help="seconds")
    parser.add_argument("--short", default="", help="FROM,TO hours: no spot GPU to be had")
    args = parser.parse_args()
    names = ["spot", "spot+on_demand", "on_demand"] if args.short else ["spot", "on_demand"]
    with ProcessPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run, name, args) for name in names]
        runs = [f.result() for f in futures]
    rows = {run["name"]: summary(run["report"]) for run in runs}
    table = Table(
        title=f"{args.hours:g} h diurnal (peak {args.peak_rps:g} req/s) + {args.lines:,} batch "
        f"lines at 00:00, {args.window:g} h window"
    )
    for column in ("batch pool", *rows):
        table.add_column(column, justify="right")
    lines = {
        "batch lines completed": lambda r: (
            f"{r['batch']['completed']:,} of {r['batch']['lines']:,}"
        ),
        "batch took (h)": lambda r: f"{(r['batch']['took_s'] or 0) / 3600:.2f}",
        "within window": lambda r: "yes" if r["batch"]["within_window"] else "NO",
        "preemptions": lambda r: f"{r['preemptions']}",
        "on-demand stand-ins": lambda r: f"{r['on_demand_stand_ins']}",
        "lines sent again": lambda r: f"{r['batch_lines_retried']:,}",
        "interactive SLO attainment": lambda r: f"{r['interactive_slo_attainment']:.2%}",
        "interactive TTFT p99 (ms)": lambda r: f"{r['interactive_ttft_p99_s'] * 1000:,.0f}",
        "batch pool GPU-hours": lambda r: f"{r['gpu_hours'][BATCH]:,.1f}",
        "batch pool $ / GPU-hour": lambda r: f"{r['usd_per_gpu_hour'][BATCH]:.2f}",
        "batch pool cost": lambda r: f"${r['usd'][BATCH]:,.0f}",
        "interactive pool cost": lambda r: f"${r['usd'][INTERACTIVE]:,.0f}",
        "total cost": lambda r: f"${r['total_usd']:,.0f}",
    }
    for label, cell in lines.items():
        table.add_row(label, *(cell(r) for r in rows.values()))
    Console().print(table)
    spot, od = rows["spot"], rows["on_demand"]
    saving = 1 - spot["usd"][BATCH] / od["usd"][BATCH] if od["usd"][BATCH] else None
    result, figure = RESULT, PLOT
    if args.short:  # a shortage scenario: kept beside the bar's results
        result, figure = (p.with_stem(p.stem + "_short") for p in (RESULT, PLOT))
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(
        json.dumps(
            {
                "command": "bench/spot_nightly_batch.py "
                f"--hours {args.hours:g} --peak-rps {args.peak_rps:g} --seed {args.seed} "
                f"--lines {args.lines} --window {args.window:g} "
                f"--batch-replicas {args.batch_replicas} --preemptions {args.preemptions:g} "
                f"--notice {args.notice:g}" + (f" --short {args.short}" if args.short else ""),
                "slo": {"ttft_ms": TTFT_SLO_S * 1000, "tpot_ms": TPOT_SLO_S * 1000},
                "runs": rows,
                "batch_cost_saving_on_spot": None if saving is None else round(saving, 4),
                "wall_s": {run["name"]: run["wall_s"] for run in runs},
            },
            indent=2,
        )
        + "\n"
    )
    plot(runs, figure)
    print(f"wrote {result.relative_to(ROOT)} and {figure.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
