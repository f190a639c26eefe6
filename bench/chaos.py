"""The 1,000-seed chaos run of the simulator (issue: a replica failure loses no request).

    .venv/bin/python bench/chaos.py                 # seeds 0-999, every CPU
    .venv/bin/python bench/chaos.py --seed 18       # one seed, its problems in full
    # table + bench/results/chaos.json; exit 1 if any invariant broke

Each seed draws a fleet, tenants, requests and a schedule of crashes, slow replicas, metric
blackouts, 5xx-answering and hung replicas (``gpufleet.sim.chaos_scenario``), runs it through the
real pool controller and checks the invariants of ``gpufleet.sim.chaos_run``: every request
ends exactly once, none waits past its deadline, no replica is routed to while ejected, no
tenant ledger count is off, no in-flight count leaks, every failure has a named cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufleet.sim import chaos_run

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def one(args: tuple[int, int]) -> dict[str, Any]:
    seed, requests = args
    started = time.perf_counter()
    result = chaos_run(seed, requests=requests)
    model = result.scenario.fleet["models"][0]
    return {
        "seed": seed,
        "problems": result.problems,
        "requests": result.requests,
        "failed": result.failed,
        "crashes": result.crashes,
        "ejections": result.ejections,
        "routes": result.routes,
        "resumed": result.resumed,
        "faults": [f.kind for f in result.scenario.faults],
        "policy": model["routing"]["policy"],
        "admission": bool(result.scenario.fleet.get("tenants", {}).get("auth")),
        "simulated_s": result.simulated_s,
        "wall_s": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, help="run only this seed and print its problems")
    parser.add_argument("--requests", type=int, default=200, help="requests per seed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = parser.parse_args()
    console = Console()
    if args.seed is not None:
        row = one((args.seed, args.requests))
        console.print(json.dumps(row, indent=1))
        return 1 if row["problems"] else 0

    seeds = range(args.first, args.first + args.seeds)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    columns = (
        TextColumn("chaos"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[bad]} broke an invariant"),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("seeds", total=len(seeds), bad=0)
        with ProcessPoolExecutor(args.jobs) as pool:
            jobs = [(seed, args.requests) for seed in seeds]
            for row in pool.map(one, jobs, chunksize=8):
                rows.append(row)
                bad = sum(1 for r in rows if r["problems"])
                progress.update(task, advance=1, bad=bad)
    wall = time.perf_counter() - started
    broken = [r for r in rows if r["problems"]]
    kinds: Counter[str] = Counter(k for r in rows for k in r["faults"])
    totals = {
        key: sum(r[key] for r in rows)
        for key in ("requests", "failed", "crashes", "ejections", "routes", "resumed")
    }
    summary = {
        "command": " ".join(["python", "bench/chaos.py", *sys.argv[1:]]),
        "seeds": len(rows),
        "first_seed": args.first,
        "requests_per_seed": args.requests,
        "jobs": args.jobs,
        "cpus": os.cpu_count(),
        "wall_s": round(wall, 1),
        "seeds_broken": len(broken),
        "totals": totals,
        "fault_kinds": dict(sorted(kinds.items())),
        "policies": dict(Counter(r["policy"] for r in rows)),
        "admission_on": sum(1 for r in rows if r["admission"]),
        "slowest_seed_s": round(max(r["wall_s"] for r in rows), 2),
        "problems": [p for r in broken for p in r["problems"][:3]][:50],
    }
    table = Table(title=f"chaos: {len(rows)} seeds in {wall:.0f} s on {args.jobs} processes")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("seeds that broke an invariant", str(len(broken)))
    for key, value in totals.items():
        table.add_row(key, f"{value:,}")
    for kind, count in sorted(kinds.items()):
        table.add_row(f"faults: {kind}", f"{count:,}")
    console.print(table)
    for problem in summary["problems"][:10]:
        console.print(f"[red]{problem}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
