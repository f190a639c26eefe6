"""A day of diurnal load on three fleets: static peak, reactive, reactive + predictive + prewarm.

    .venv/bin/python bench/autoscale_diurnal.py            # ~1 h of CPU on a 2-core box
    .venv/bin/python bench/autoscale_diurnal.py --hours 6  # a quicker partial day

What ``gpufleet trace synth`` + ``gpufleet simulate --compare`` run (docs/autoscaling-results.md),
with the three fleets in parallel processes (``--jobs``; results do not depend on it):

1. the trace: ``synth_requests(DiurnalCurve(peak_rps), Azure 2023 conversation sizes, seed)``;
2. each of ``examples/diurnal-{static,reactive,autoscale}.yaml`` through ``FleetSimulation``
   with the stated SLO (TTFT ≤ 1 s and mean inter-token latency ≤ 60 ms per request);
3. a table (GPU-hours and the saving against the static baseline of the same run, SLO
   attainment, TTFT and ITL P99, scale-up lags), ``bench/results/autoscale_diurnal.json``
   and ``bench/results/autoscale_diurnal.png`` (replicas serving and GPUs charged over the day).

The issue's bar: at least 35 % fewer GPU-hours than static peak with attainment ≥ 99 %.
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

from gpufleet.config import load_fleet
from gpufleet.sim import DiurnalCurve, FleetSimulation, SimOptions, load_trace, synth_requests

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
FLEETS = ("diurnal-static", "diurnal-reactive", "diurnal-autoscale")
RESULT = ROOT / "bench" / "results" / "autoscale_diurnal.json"
PLOT = ROOT / "bench" / "results" / "autoscale_diurnal.png"
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.060


def run_fleet(name: str, hours: float, peak_rps: float, seed: int) -> dict[str, Any]:
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(AZURE)]
    trace = synth_requests(DiurnalCurve(peak_rps=peak_rps, hours=hours), sizes, seed=seed)
    options = SimOptions(seed=0, sample_interval=60.0, ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S)
    sim = FleetSimulation(load_fleet(ROOT / "examples" / f"{name}.yaml"), options)
    sim.start(trace)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    if problems:
        raise RuntimeError(f"{name}: {problems}")
    report = sim.report({"hours": hours, "peak_rps": peak_rps, "seed": seed})
    return {"name": name, "wall_s": round(wall, 1), "report": report}


def serving_total(timeline: dict[str, Any]) -> list[int]:
    """Replicas serving at each sample, all models together."""
    phases = [p["serving"] for p in timeline["phases"].values()]
    return [sum(column) for column in zip(*phases, strict=True)]


def summary(report: dict[str, Any]) -> dict[str, Any]:
    o = report["overall"]
    lags = [a["lag"] for a in report["autoscale"].values()]
    serving = [
        sum(c)
        for c in zip(*(p["serving"] for p in report["timeline"]["phases"].values()), strict=False)
    ]
    return {
        "requests": o["requests"],
        "failed": o["failed"],
        "gpu_hours": report["cost"]["gpu_hours"],
        "usd": report["cost"]["usd"],
        "gpu_hours_by_phase": {
            k: round(sum(m["gpu_hours_by_phase"][k] for m in report["cost"]["models"].values()), 3)
            for k in ("serving", "starting", "standby", "draining")
        },
        "slo_attainment": o["slo"]["attainment"],
        "ttft_p99_s": o["ttft_s"]["p99"],
        "itl_p99_s": o["itl_s"]["p99"],
        "tpot_p99_s": o["tpot_s"]["p99"],
        "replicas_serving": {
            "min": min(serving),
            "mean": round(sum(serving) / len(serving), 2),
            "max": max(serving),
        },
        "scale_ups": sum(a["scale_ups"] for a in report["autoscale"].values()),
        "scale_downs": sum(a["scale_downs"] for a in report["autoscale"].values()),
        "lag_decision_to_serving_s": lags[0]["decision_to_serving_s"] if lags else None,
        "lag_over_target_s": lags[0]["over_target"] if lags else None,
    }


def plot(runs: list[dict[str, Any]]) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, layout="constrained")
    first = runs[0]["report"]["timeline"]
    hours = [t / 3600 for t in first["t"]]
    rate = [a / first["interval_s"] for a in first["arrivals"]]
    twin = top.twinx()
    twin.plot(hours, rate, color="0.6", linewidth=0.7, label="arrivals / s")
    twin.set_ylabel("arrivals / s")
    for run in runs:
        timeline = run["report"]["timeline"]
        serving = [
            sum(c) for c in zip(*(p["serving"] for p in timeline["phases"].values()), strict=False)
        ]
        t = [x / 3600 for x in timeline["t"]]
        top.step(t, serving, where="post", label=run["name"], linewidth=1.3)
        bottom.step(t, timeline["gpus"], where="post", label=run["name"], linewidth=1.3)
    top.set_ylabel("replicas serving")
    top.set_title("Replicas serving over the day (grey: arrival rate)")
    top.legend(loc="upper left", fontsize="small")
    bottom.set_ylabel("GPUs charged")
    bottom.set_xlabel("hour of the day")
    bottom.set_title("GPUs charged (provisioning, loading, standby, serving, draining)")
    bottom.legend(loc="upper left", fontsize="small")
    fig.savefig(PLOT, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--peak-rps", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=3)
    args = parser.parse_args()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_fleet, f, args.hours, args.peak_rps, args.seed) for f in FLEETS]
        runs = [f.result() for f in futures]
    rows = {run["name"]: summary(run["report"]) for run in runs}
    base = rows[FLEETS[0]]["gpu_hours"]
    table = Table(title=f"{args.hours:g} h diurnal, peak {args.peak_rps:g} req/s, seed {args.seed}")
    for column in ("", *rows):
        table.add_column(column, justify="right")

    def lag(row: dict[str, Any], key: str, field: str) -> str:
        value = (row[key] or {}).get(field)
        return "—" if value is None else f"{value:,.0f}"

    lines = {
        "GPU-hours": lambda r: f"{r['gpu_hours']:,.1f}",
        "vs static": lambda r: f"{(r['gpu_hours'] - base) / base:+.1%}",
        "SLO attainment": lambda r: f"{r['slo_attainment']:.2%}",
        "TTFT p99 (ms)": lambda r: f"{r['ttft_p99_s'] * 1000:,.0f}",
        "ITL p99 (ms)": lambda r: f"{r['itl_p99_s'] * 1000:,.1f}",
        "replicas min / mean / max": lambda r: "{min} / {mean} / {max}".format(
            **r["replicas_serving"]
        ),
        "scale ups / downs": lambda r: f"{r['scale_ups']} / {r['scale_downs']}",
        "lag decision→serving p50 / max (s)": lambda r: (
            lag(r, "lag_decision_to_serving_s", "p50")
            + " / "
            + lag(r, "lag_decision_to_serving_s", "max")
        ),
        "over target: episodes / max (s)": lambda r: (
            "—"
            if r["lag_over_target_s"] is None
            else f"{r['lag_over_target_s']['episodes']} / {lag(r, 'lag_over_target_s', 'max')}"
        ),
    }
    for label, cell in lines.items():
        table.add_row(label, *(cell(r) for r in rows.values()))
    Console().print(table)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "command": "bench/autoscale_diurnal.py "
                f"--hours {args.hours:g} --peak-rps {args.peak_rps:g} --seed {args.seed}",
                "slo": {"ttft_ms": TTFT_SLO_S * 1000, "tpot_ms": TPOT_SLO_S * 1000},
                "fleets": rows,
                "wall_s": {run["name"]: run["wall_s"] for run in runs},
            },
            indent=2,
        )
        + "\n"
    )
    plot(runs)
    print(f"wrote {RESULT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
