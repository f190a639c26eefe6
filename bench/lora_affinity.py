"""50 LoRA adapters over 4 replicas: affinity routing vs load-on-any-replica.

    .venv/bin/python bench/lora_affinity.py                  # ~2 minutes on a 2-core box
    .venv/bin/python bench/lora_affinity.py --minutes 30     # longer

Issue 16's simulated bar (docs/residency.md, "LoRA adapters"):

1. the trace: Poisson arrivals at each of ``--rps`` (4, 8 and 16 req/s) for ``--minutes``
   (``synth_requests`` on a flat curve), request sizes from the packaged Azure 2023
   conversation hour, each request naming one of 50 adapters of one base model by a
   Zipf(``--zipf``) mix (``zipf_models``);
2. one fleet, 4 replicas of ``llama-3.1-8b`` on H100s, ``max_loras: 8`` (32 adapter slots
   for 50 adapters), routed ``least_request``, run four ways through ``FleetSimulation`` (the
   controller the gateway runs, the modelled engines):
   * **affinity**: the controller's adapter placement (a holder within the load guard, else
     a load where an eviction costs least; evict the least demanded idle adapter);
   * **any + LRU**: ``lora: {affinity: false, evict: lru}``: the router's pick, loading the
     adapter there when it lacks it and evicting the least recently used — what a plain
     router in front of vLLM engines that load adapters on demand does (vLLM's adapter cache
     is an LRU): the baseline;
   * two ablations, to show where the gain comes from: affinity with LRU eviction, and the
     router's pick with the demand eviction;
3. a table, ``bench/results/lora_affinity.json`` and ``.png``: adapter loads per 1,000
   requests, the time requests waited for loads, TTFT P50/P99 (all requests, and per
   adapter), and the ratios of affinity to the baseline at each rate. The bar: affinity cuts loads
   per 1,000 requests by ≥ 5× at equal or better TTFT P99.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.sim import (
    SAMPLE_TRACE,
    DiurnalCurve,
    FleetSimulation,
    SimOptions,
    load_trace,
    synth_requests,
    zipf_models,
    zipf_weights,
)

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "lora_affinity.json"
PLOT = ROOT / "bench" / "results" / "lora_affinity.png"
ADAPTERS = [f"ft-{k:02d}" for k in range(1, 51)]
"""By popularity: ``ft-01`` is asked for most."""
REPLICAS, MAX_LORAS = 4, 8


VARIANTS = {
    "affinity": (True, "demand"),
    "any + LRU": (False, "lru"),
    "affinity + LRU": (True, "lru"),
    "any + demand": (False, "demand"),
}
"""Name → (``lora.affinity``, ``lora.evict``): ours, the baseline, two ablations."""


def fleet(affinity: bool, evict: str) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": "base",
                    "model": "llama-3.1-8b",
                    "gpu": "h100-sxm",
                    "replicas": REPLICAS,
                    "routing": "least_request",
                    "lora": {
                        "max_loras": MAX_LORAS,
                        "affinity": affinity,
                        "evict": evict,
                        "adapters": [
                            {"name": a, "path": f"/adapters/{a}", "rank": 16} for a in ADAPTERS
                        ],
                    },
                }
            ],
        },
        source="bench/lora_affinity.py",
    )


def run(name: str, minutes: float, rps: float, zipf: float, seed: int) -> dict[str, Any]:
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(SAMPLE_TRACE)]
    curve = DiurnalCurve(peak_rps=rps, hours=minutes / 60, trough=1.0, spikes=())
    trace = list(zipf_models(synth_requests(curve, sizes, seed=seed), ADAPTERS, s=zipf, seed=seed))
    sim = FleetSimulation(fleet(*VARIANTS[name]), SimOptions(seed=seed, sample_interval=60.0))
    sim.start(trace)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    if problems:
        raise RuntimeError(problems)
    log = list(sim.harness.recorder.log)
    ttft = sorted(r.first_token_s - r.arrival_s for r in log if r.first_token_s is not None)
    by_adapter: dict[str, list[float]] = {a: [] for a in ADAPTERS}
    for r in log:
        if r.first_token_s is not None:
            by_adapter[str(trace[r.index].model)].append(r.first_token_s - r.arrival_s)
    section = sim.report({})["adapters"]
    pool = section["pools"]["base"]
    return {
        "fleet": name,
        "requests": len(log),
        "failed": sum(1 for r in log if r.failed or r.rejected),
        "attempts": pool["requests"],
        "loads": pool["loads"],
        "loads_per_1000": pool["loads_per_1000"],
        "unloads": pool["unloads"],
        "over_cap": pool["over_cap"],
        "waited_for_a_load": section["waited"],
        "load_wait_s": section["wait_seconds"],
        "ttft_s": _quantiles(ttft),
        "ttft_s_by_adapter": {a: _quantiles(sorted(v)) for a, v in by_adapter.items()},
        "wall_s": round(wall, 1),
        "ttft_sorted": [round(x, 4) for x in ttft],
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    n = len(values)
    return {
        "p50": round(values[(n - 1) // 2], 4),
        "p99": round(values[int(0.99 * (n - 1))], 4),
        "max": round(values[-1], 4),
    }


def table(results: list[dict[str, Any]], rps: float) -> Table:
    t = Table(
        title=f"{len(ADAPTERS)} adapters (Zipf) on {REPLICAS} replicas × {MAX_LORAS} slots, "
        f"{rps:g} req/s"
    )
    for col in ("routing", "requests", "failed", "loads", "loads / 1,000", "waited",
                "TTFT P50", "TTFT P99", "TTFT max"):  # fmt: skip
        t.add_column(col)
    for r in results:
        q = r["ttft_s"]
        t.add_row(
            r["fleet"], str(r["requests"]), str(r["failed"]), str(r["loads"]),
            f"{r['loads_per_1000']:.1f}", str(r["waited_for_a_load"]),
            f"{q['p50']:.3f} s", f"{q['p99']:.3f} s", f"{q['max']:.3f} s",
        )  # fmt: skip
    return t


def _ratios(results: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, bool]]:
    affinity, baseline = results[0], results[1]
    ratios = {
        "loads_per_1000_baseline_over_affinity": round(
            baseline["loads_per_1000"] / affinity["loads_per_1000"], 2
        ),
        "ttft_p99_affinity_over_baseline": round(
            affinity["ttft_s"]["p99"] / baseline["ttft_s"]["p99"], 3
        ),
        "ttft_p50_affinity_over_baseline": round(
            affinity["ttft_s"]["p50"] / baseline["ttft_s"]["p50"], 3
        ),
    }
    bar = {
        "loads_cut_5x": ratios["loads_per_1000_baseline_over_affinity"] >= 5,
        "ttft_p99_equal_or_better": affinity["ttft_s"]["p99"] <= baseline["ttft_s"]["p99"],
    }
    return ratios, bar


def plot(runs: list[dict[str, Any]], inputs: dict[str, Any]) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (loads, p99, cdf) = plt.subplots(1, 3, figsize=(16, 4.5))
    rates = [run["rps"] for run in runs]
    for k, name in enumerate(VARIANTS):
        rows = [run["results"][k] for run in runs]
        loads.plot(rates, [r["loads_per_1000"] for r in rows], marker="o", label=name)
        p99.plot(rates, [r["ttft_s"]["p99"] for r in rows], marker="o", label=name)
    main = next((run for run in runs if run["rps"] == inputs["headline_rps"]), runs[0])
    for r in main["results"]:
        xs = r["ttft_sorted"]
        n = len(xs)
        cdf.plot(xs, [(i + 1) / n for i in range(n)], label=r["fleet"])
    loads.set_xlabel("arrival rate (req/s)")
    loads.set_ylabel("adapter loads per 1,000 requests")
    loads.set_yscale("log")
    loads.set_title("adapter loads")
    loads.legend()
    p99.set_xlabel("arrival rate (req/s)")
    p99.set_ylabel("TTFT P99 (s)")
    p99.set_title("TTFT P99")
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("share of requests")
    cdf.set_title(f"TTFT at {main['rps']:g} req/s")
    cdf.legend()
    share = zipf_weights(len(ADAPTERS), inputs["zipf"])
    fig.suptitle(
        f"{len(ADAPTERS)} LoRA adapters (Zipf {inputs['zipf']}: {share[0]:.0%} … "
        f"{share[-1]:.1%}) on {REPLICAS} replicas × {MAX_LORAS} slots, {inputs['minutes']:g} min "
        "each (bench/lora_affinity.py)"
    )
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--rps", default="4,8,16", help="arrival rates, comma-separated (req/s); each is a run"
    )
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(x) for x in args.rps.split(",")]
    inputs: dict[str, Any] = {
        "minutes": args.minutes,
        "rps": args.rps,
        "zipf": args.zipf,
        "seed": args.seed,
        "headline_rps": 8.0 if 8.0 in rates else rates[0],
    }
    runs: list[dict[str, Any]] = []
    console = Console()
    for rps in rates:
        results = [run(name, args.minutes, rps, args.zipf, args.seed) for name in VARIANTS]
        ratios, bar = _ratios(results)
        console.print(table(results, rps))
        console.print(ratios, bar)
        runs.append({"rps": rps, "results": results, "ratios": ratios, "bar": bar})
    out = {
        "command": f"python bench/lora_affinity.py --minutes {args.minutes:g} --rps {args.rps} "
        f"--zipf {args.zipf} --seed {args.seed}",
        "inputs": {
            **inputs,
            "adapters": len(ADAPTERS),
            "replicas": REPLICAS,
            "max_loras": MAX_LORAS,
            "model": "llama-3.1-8b",
            "gpu": "h100-sxm",
            "rank": 16,
        },
        "runs": [
            {
                **run,
                "results": [
                    {k: v for k, v in r.items() if k != "ttft_sorted"} for r in run["results"]
                ],
            }
            for run in runs
        ],
    }
    RESULT.write_text(json.dumps(out, indent=2) + "\n")
    plot(runs, inputs)
    console.print(f"wrote {RESULT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
