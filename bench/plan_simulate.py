"""``gpufleet plan --simulate`` against its bar (issue 20), and its picks against a wider grid.

    .venv/bin/python bench/plan_simulate.py                 # the bar, then every scenario
    .venv/bin/python bench/plan_simulate.py --skip-bar --scenarios 8b-azure-relaxed
    # table + bench/results/plan_simulate.{json,png} (+ the bar runs' Pareto plots)

1. **The bar.** ``gpufleet plan --simulate`` (the real command, a child process) on the
   packaged Azure 2023 conversation hour (19,366 requests) for Llama-3.1-8B and -70B over
   H100-SXM, A100-80GB-SXM and L40S, default SLO (TTFT p99 ≤ 2 s, TPOT p50 ≤ 50 ms),
   ``--jobs`` = the CPU count: wall time of each (the bar: ≤ 5 minutes on this 2-core
   machine).
2. **Scenarios** (models × load × SLOs, on 5–10 minute slices of the same trace, at 0.5×,
   1× and 4× its rate). ``plan --simulate`` over *every* catalog GPU type, then an
   exhaustive grid wider than its candidates: every catalog GPU type × TP 1,
   2, 4, 8 × every serving count whose fleet (serving + the N+1 spare) costs no more than
   the pick, plus the pick's own count + 1, each simulated to the end with no early stop.
   The pick is right when no grid fleet that meets the SLO is cheaper. The plain
   planner's pick, simulated, is tabled beside it. A grid over ``--max-grid`` fleets is
   skipped (a Mooncake scenario's, 948 fleets at 12k-token prompts, was too slow here).

The grid's fleets are the pick's written fleet file with ``models[0].gpu``, ``tp`` and
``replicas`` set (``gpufleet.config.set_field``): the same engine flags and routing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from gpufleet.catalog import load_gpus
from gpufleet.config import parse_fleet, set_field
from gpufleet.sim import (
    SAMPLE_TRACE,
    FleetSimulation,
    SimOptions,
    SLOTarget,
    SweepCandidate,
    SweepRun,
    SweepStatus,
    TraceSpec,
    cheapest_met,
    run_sweep,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BAR_GPUS = "h100-sxm,a100-80gb-sxm,l40s"
TPS = (1, 2, 4, 8)
console = Console(highlight=False, width=200)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    trace: Path
    duration: float
    rate_scale: float
    slo: tuple[str, ...]


RELAXED = ("--ttft-p99-ms", "2000", "--tpot-ms", "50")
SCENARIOS = [
    Scenario("8b-azure-relaxed", "llama-3.1-8b", SAMPLE_TRACE, 600, 1.0, RELAXED),
    Scenario(
        "8b-azure-tight", "llama-3.1-8b", SAMPLE_TRACE, 600, 1.0,
        ("--ttft-p99-ms", "500", "--tpot-ms", "25"),
    ),
    Scenario(
        "8b-azure-p50", "llama-3.1-8b", SAMPLE_TRACE, 600, 1.0,
        ("--ttft-p99-ms", "5000", "--ttft-p50-ms", "150", "--tpot-ms", "40", "--tpot-p99-ms", "60"),
    ),
    Scenario("8b-azure-x4-relaxed", "llama-3.1-8b", SAMPLE_TRACE, 300, 4.0, RELAXED),
    Scenario(
        "8b-azure-attainment", "llama-3.1-8b", SAMPLE_TRACE, 600, 1.0,
        ("--ttft-p99-ms", "1000", "--tpot-ms", "30", "--attainment", "0.95"),
    ),
    Scenario("70b-azure-relaxed", "llama-3.1-70b", SAMPLE_TRACE, 600, 1.0, RELAXED),
    Scenario(
        "70b-azure-tight", "llama-3.1-70b", SAMPLE_TRACE, 600, 1.0,
        ("--ttft-p99-ms", "1000", "--tpot-ms", "30"),
    ),
    Scenario("70b-azure-half-relaxed", "llama-3.1-70b", SAMPLE_TRACE, 600, 0.5, RELAXED),
    Scenario(
        "70b-azure-attainment", "llama-3.1-70b", SAMPLE_TRACE, 600, 1.0,
        ("--ttft-p99-ms", "2000", "--tpot-ms", "50", "--attainment", "0.9"),
    ),
]  # fmt: skip


def plan_simulate(args: list[str], out: Path, jobs: int) -> tuple[dict[str, Any], float]:
    """``gpufleet plan --simulate`` as a child process: its JSON and wall time."""
    command = [sys.executable, "-m", "gpufleet", "plan", "--simulate", "--jobs", str(jobs)]
    command += [*args, "--out", str(out)]
    env = {**os.environ, "COLUMNS": "200"}
    wall = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - wall
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads((out / "plan-simulate.json").read_text()), wall


def the_bar(jobs: int, work: Path) -> list[dict[str, Any]]:
    rows = []
    for model, short in (("llama-3.1-8b", "8b"), ("llama-3.1-70b", "70b")):
        console.print(f"[bold]bar:[/] plan --simulate {model} on the Azure conversation hour")
        out = work / f"bar-{short}"
        report, wall = plan_simulate(["--model", model, "--gpu", BAR_GPUS], out, jobs)
        shutil.copy(out / "pareto.png", RESULTS / f"plan_simulate_{short}_pareto.png")
        rows.append({"model": model, "wall_s": round(wall, 1), **summary(report)})
        console.print(f"  {wall:.1f} s wall; pick {report['pick']}", highlight=False)
    return rows


def summary(report: dict[str, Any]) -> dict[str, Any]:
    rows = {r["name"]: r for r in report["candidates"]}
    pick, planned = rows.get(report["pick"] or ""), rows.get(report["planner_pick"] or "")
    statuses: dict[str, int] = {}
    for r in report["candidates"]:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "requests": report["inputs"]["requests"],
        "candidates": len(rows),
        "statuses": statuses,
        "simulated_s_total": round(
            sum(r["simulated_s"] or r["stopped_at_s"] or 0.0 for r in rows.values()), 1
        ),
        "pick": None if pick is None else brief(pick),
        "planner_pick": None if planned is None else brief(planned),
        "planner_pick_verdict": report["planner_pick_verdict"],
    }


def brief(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"],
        "usd_per_hour": row["usd_per_hour"],
        "status": row["status"],
        "ttft_p99_s": None if row["ttft_s"] is None else row["ttft_s"]["p99"],
        "tpot_p50_s": None if row["tpot_s"] is None else row["tpot_s"]["p50"],
        "attainment": row["attainment"],
    }


def grid(
    report: dict[str, Any], fleet: dict[str, Any]
) -> list[tuple[SweepCandidate, dict[str, Any]]]:
    """Every GPU type × TP × serving count costing no more than the pick (+ its count + 1)."""
    pick = next(r for r in report["candidates"] if r["name"] == report["pick"])
    spares = pick["replicas"] - pick["serving"]
    limit = pick["usd_per_hour"]
    out = []
    for gpu in load_gpus().values():
        for tp in TPS:
            serving = 1
            while True:
                usd = round((serving + spares) * tp * gpu.price_per_hour_usd, 4)
                mine = (gpu.name, tp) == (pick["gpu"], pick["tp"])
                if usd > limit and not (mine and serving == pick["serving"] + 1):
                    break
                data = fleet
                for path, value in (
                    ("models[0].gpu", gpu.name), ("models[0].tp", tp),
                    ("models[0].replicas", serving),
                ):  # fmt: skip
                    data = set_field(data, path, value)
                name = f"{gpu.name} TP{tp} {serving}+{spares}"
                try:
                    config = parse_fleet(data, source=name)
                    FleetSimulation(config, SimOptions())  # fits? (a replica is built)
                except ValueError:
                    break  # no more replicas fit either
                out.append(
                    (
                        SweepCandidate(name, config, usd),
                        {"gpu": gpu.name, "tp": tp, "serving": serving},
                    )
                )
                serving += 1
    return out


def scenario_run(s: Scenario, jobs: int, work: Path, max_grid: int) -> dict[str, Any]:
    console.print(f"[bold]{s.name}[/]: plan --simulate over every catalog GPU type")
    gpus = ",".join(load_gpus())
    out = work / s.name
    args = [
        "--model",
        s.model,
        "--gpu",
        gpus,
        "--trace",
        str(s.trace),
        "--duration",
        str(s.duration),
    ]
    args += ["--rate-scale", str(s.rate_scale), *s.slo, "--no-plots"]
    report, wall = plan_simulate(args, out, jobs)
    row: dict[str, Any] = {
        "scenario": s.name,
        "model": s.model,
        "trace": s.trace.name,
        "duration_s": s.duration,
        "rate_scale": s.rate_scale,
        "slo_flags": list(s.slo),
        "wall_s": round(wall, 1),
        **summary(report),
    }
    if report["pick"] is None:
        console.print("  no pick: no grid to compare", highlight=False)
        return row
    fleet = yaml.safe_load((out / "fleet.yaml").read_text())
    cells = grid(report, fleet)
    if len(cells) > max_grid:
        console.print(f"  grid: {len(cells)} fleets, more than --max-grid: skipped")
        row["grid_skipped"] = f"{len(cells)} fleets, more than --max-grid {max_grid}"
        return row
    slo = SLOTarget(**report["slo"])
    inputs = report["inputs"]
    run = SweepRun(
        TraceSpec(s.trace, rate_scale=s.rate_scale, duration=s.duration, seed=inputs["seed"]),
        SimOptions(seed=inputs["seed"], ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s),
        slo,
        inputs["requests"],
        inputs["span_s"],
        prune=False,
    )
    console.print(f"  grid: {len(cells)} fleets, each to the end", highlight=False)
    grid_wall = time.perf_counter()
    results = run_sweep([c for c, _ in cells], run, jobs=jobs)
    grid_wall = time.perf_counter() - grid_wall
    best = cheapest_met(results)
    pick_cost = row["pick"]["usd_per_hour"]
    cheaper = [r for r in results if r.status is SweepStatus.MET and r.usd_per_hour < pick_cost]
    row["grid"] = {
        "fleets": len(cells),
        "met": sum(r.status is SweepStatus.MET for r in results),
        "wall_s": round(grid_wall, 1),
        "cheapest_met": None
        if best is None
        else {"name": best.name, "usd_per_hour": best.usd_per_hour},
        "cheaper_than_pick": [{"name": r.name, "usd_per_hour": r.usd_per_hour} for r in cheaper],
        "fleets_simulated": [
            {
                "name": r.name,
                "usd_per_hour": r.usd_per_hour,
                "status": r.status.value,
                "reasons": list(r.reasons),
            }
            for r in results
        ],
    }
    row["pick_is_cheapest"] = not cheaper
    verdict = "[green]cheapest[/]" if not cheaper else f"[red]beaten by {cheaper[0].name}[/]"
    console.print(f"  pick {report['pick']} ${pick_cost:,.2f}/h: {verdict}", highlight=False)
    return row


def plot(bar: list[dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 4.8), layout="constrained", width_ratios=(1, 3)
    )
    left.bar([b["model"] for b in bar], [b["wall_s"] for b in bar], color="tab:blue")
    left.axhline(300, color="tab:red", linestyle="--", label="bar: 5 min")
    left.set_ylabel("wall seconds")
    left.set_title("plan --simulate, Azure conv. hour")
    left.legend(loc="upper left", fontsize="small")
    names = [r["scenario"] for r in rows if r.get("pick")]
    xs = range(len(names))
    picks = [r["pick"]["usd_per_hour"] for r in rows if r.get("pick")]
    planned = [
        (r["planner_pick"] or {}).get("usd_per_hour", float("nan")) for r in rows if r.get("pick")
    ]
    grid_best = [
        ((r.get("grid") or {}).get("cheapest_met") or {}).get("usd_per_hour", float("nan"))
        for r in rows
        if r.get("pick")
    ]
    width = 0.27
    right.bar([x - width for x in xs], planned, width, label="plain planner's pick", color="0.7")
    right.bar(list(xs), picks, width, label="plan --simulate pick", color="tab:green")
    right.bar(
        [x + width for x in xs], grid_best, width, label="grid's cheapest met", color="tab:purple"
    )
    right.set_xticks(list(xs), names, rotation=25, ha="right", fontsize="small")
    right.set_ylabel("USD per hour")
    right.set_title("picks against the exhaustive wider grid")
    right.legend(fontsize="small")
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-bar", action="store_true")
    parser.add_argument("--scenarios", default="all", help="comma-separated names, or all")
    parser.add_argument("--max-grid", type=int, default=150, help="skip larger grids")
    args = parser.parse_args()
    chosen = SCENARIOS if args.scenarios == "all" else [
        s for s in SCENARIOS if s.name in args.scenarios.split(",")
    ]  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "plan_simulate.json"
    if args.skip_bar or args.scenarios != "all":
        path = RESULTS / "plan_simulate_partial.json"
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after each step: a long run interrupted keeps what it measured
        result = {
            "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
            "jobs": args.jobs,
            "bar": bar,
            "scenarios": rows,
        }
        path.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bar = [] if args.skip_bar else the_bar(args.jobs, work)
        save()
        for s in chosen:
            rows.append(scenario_run(s, args.jobs, work, args.max_grid))
            save()
    table = Table(title="plan --simulate: picks against the wider grid")
    for column in (
        "scenario",
        "wall",
        "cands",
        "pick",
        "$/h",
        "grid fleets",
        "grid cheapest",
        "planner's pick",
    ):
        table.add_column(column)
    for r in rows:
        grid_row = r.get("grid") or {}
        best = grid_row.get("cheapest_met") or {}
        planned = r["planner_pick"]
        table.add_row(
            r["scenario"],
            f"{r['wall_s']:.0f} s",
            str(r["candidates"]),
            (r["pick"] or {}).get("name", "—"),
            f"{r['pick']['usd_per_hour']:,.2f}" if r["pick"] else "—",
            str(grid_row.get("fleets", "—")),
            f"{best.get('name', '—')} {best.get('usd_per_hour', '')}",
            "—"
            if planned is None
            else f"{planned['name']} ${planned['usd_per_hour']:,.2f} {planned['status']}",
        )
    console.print(table)
    for b in bar:
        console.print(f"bar {b['model']}: {b['wall_s']} s wall, pick {b['pick']}", highlight=False)
    if bar and rows:
        plot(bar, rows, RESULTS / "plan_simulate.png")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
