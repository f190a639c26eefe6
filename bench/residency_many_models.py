"""20 models over 8 GPUs on demand vs 20 GPUs always resident: GPU-hours and TTFT.

    .venv/bin/python bench/residency_many_models.py              # a few minutes on a 2-core box
    .venv/bin/python bench/residency_many_models.py --minutes 10 # quicker

Issue 16's simulated bar (docs/residency.md, "Tests and numbers"):

1. the trace: Poisson arrivals at ``--rps`` for ``--minutes`` (``synth_requests`` on a flat
   curve), request sizes from the packaged Azure 2023 conversation hour, each request
   naming one of 20 models by a Zipf(``--zipf``) mix (``zipf_models``);
2. two fleets of ``llama-3.1-8b`` on H100s through ``FleetSimulation`` (the controller the
   gateway runs, the modelled engines):
   * **always**: each model one replica on a GPU of its own: 20 GPUs;
   * **on demand**: each model one replica on each of 8 GPU slots (``residency.slots``),
     asleep but where the controller wakes it: at most one model awake per GPU (0.9 of its
     memory each), the others asleep at level 1 (weights in host memory), evicted by
     value (demand × wake time); 8 GPUs;
3. a table, ``bench/results/residency_many_models.json`` and ``.png``: GPU-hours (GPUs held
   × the run's span), TTFT P50/P99/max, the requests that waited for a wake, the wakes, and
   the time spent waking.
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
RESULT = ROOT / "bench" / "results" / "residency_many_models.json"
PLOT = ROOT / "bench" / "results" / "residency_many_models.png"
MODELS = [f"m{k:02d}" for k in range(1, 21)]
"""By popularity: ``m01`` is asked for most."""
GPUS = 8


def fleet(on_demand: bool) -> FleetConfig:
    residency: dict[str, Any] = (
        {"mode": "on_demand", "slots": "gpus", "idle": 300, "min_awake": 2.0}
        if on_demand
        else {"mode": "always"}
    )
    return parse_fleet(
        {
            "gateway": {"autoscaler": {"hold_timeout": 120, "hold_requests": 1024}},
            "models": [
                {
                    "name": name,
                    "model": "llama-3.1-8b",
                    "gpu": "h100-sxm",
                    "replicas": GPUS if on_demand else 1,
                    "routing": "least_request",
                    "residency": residency,
                }
                for name in MODELS
            ],
        },
        source="bench/residency_many_models.py",
    )


def run(on_demand: bool, minutes: float, rps: float, zipf: float, seed: int) -> dict[str, Any]:
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(SAMPLE_TRACE)]
    curve = DiurnalCurve(peak_rps=rps, hours=minutes / 60, trough=1.0, spikes=())
    trace = list(zipf_models(synth_requests(curve, sizes, seed=seed), MODELS, s=zipf, seed=seed))
    sim = FleetSimulation(fleet(on_demand), SimOptions(seed=seed, sample_interval=60.0))
    sim.start(trace)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    if problems:
        raise RuntimeError(problems)
    log = list(sim.harness.recorder.log)
    span = max(r.finish_s for r in log)
    ttft = sorted(r.first_token_s - r.arrival_s for r in log if r.first_token_s is not None)
    control = sim.control
    held = sum(pool.counters.hold_served for pool in control.pools.values())
    timeouts = sum(pool.counters.hold_timeouts for pool in control.pools.values())
    gpus = GPUS if on_demand else len(MODELS)
    residency = control.residency
    counters = residency.counters if residency is not None else None
    by_model: dict[str, list[float]] = {m: [] for m in MODELS}
    for r in log:
        if r.first_token_s is not None:
            by_model[str(trace[r.index].model)].append(r.first_token_s - r.arrival_s)
    per_model = {m: _quantiles(sorted(v)) for m, v in by_model.items()}
    return {
        "fleet": "on_demand" if on_demand else "always",
        "gpus": gpus,
        "span_s": round(span, 1),
        "gpu_hours": round(gpus * span / 3600, 3),
        "requests": len(log),
        "failed": sum(1 for r in log if r.failed or r.rejected),
        "held_for_a_wake": held,
        "hold_timeouts": timeouts,
        "ttft_s": _quantiles(ttft),
        "ttft_s_by_model": per_model,
        "wakes": counters.wakes if counters else 0,
        "wake_seconds_total": round(counters.wake_seconds, 3) if counters else 0.0,
        "evictions": counters.evictions if counters else 0,
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


def table(results: list[dict[str, Any]]) -> Table:
    t = Table(title="20 models (Zipf) on 8 GPUs on demand vs 20 GPUs always resident")
    for col in ("fleet", "GPUs", "GPU-h", "requests", "failed", "held", "wakes", "TTFT P50",
                "TTFT P99", "TTFT max"):  # fmt: skip
        t.add_column(col)
    for r in results:
        q = r["ttft_s"]
        t.add_row(
            r["fleet"], str(r["gpus"]), f"{r['gpu_hours']:.2f}", str(r["requests"]),
            str(r["failed"]), str(r["held_for_a_wake"]), str(r["wakes"]),
            f"{q['p50']:.3f} s", f"{q['p99']:.3f} s", f"{q['max']:.3f} s",
        )  # fmt: skip
    return t


def plot(results: list[dict[str, Any]], inputs: dict[str, Any]) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (cdf, ranks) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        xs = r["ttft_sorted"]
        n = len(xs)
        label = f"{r['fleet']}: {r['gpus']} GPUs, {r['gpu_hours']:.2f} GPU-h"
        cdf.plot(xs, [(i + 1) / n for i in range(n)], label=label)
        p99 = [r["ttft_s_by_model"][m]["p99"] or 0.0 for m in MODELS]
        ranks.plot(range(1, len(MODELS) + 1), p99, marker="o", label=r["fleet"])
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT, all requests")
    cdf.legend()
    share = zipf_weights(len(MODELS), inputs["zipf"])
    ranks.set_xlabel(
        f"model popularity rank (Zipf {inputs['zipf']}: {share[0]:.0%} … {share[-1]:.1%})"
    )
    ranks.set_ylabel("TTFT P99 (s)")
    ranks.set_yscale("log")
    ranks.set_title("TTFT P99 per model")
    ranks.legend()
    fig.suptitle(
        f"20 models, {inputs['rps']} req/s for {inputs['minutes']:g} min "
        f"(bench/residency_many_models.py)"
    )
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rps", type=float, default=2.0)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    inputs = {"minutes": args.minutes, "rps": args.rps, "zipf": args.zipf, "seed": args.seed}
    results = [
        run(on_demand, args.minutes, args.rps, args.zipf, args.seed) for on_demand in (False, True)
    ]
    always, on_demand = results
    Console().print(table(results))
    ratios = {
        "gpu_hours": round(on_demand["gpu_hours"] / always["gpu_hours"], 3),
        "ttft_p50": round(on_demand["ttft_s"]["p50"] / always["ttft_s"]["p50"], 2),
        "ttft_p99": round(on_demand["ttft_s"]["p99"] / always["ttft_s"]["p99"], 2),
    }
    print("on demand / always:", ratios)
    RESULT.write_text(
        json.dumps(
            {
                "inputs": inputs,
                "ratios_on_demand_over_always": ratios,
                "fleets": [{k: v for k, v in r.items() if k != "ttft_sorted"} for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    plot(results, inputs)
    print(f"wrote {RESULT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
