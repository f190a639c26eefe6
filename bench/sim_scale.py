"""Scale: 1,000 replicas and a million synthetic requests, in bounded memory.

    .venv/bin/python bench/sim_scale.py                      # 1,000 replicas, 1,000,000 requests
    .venv/bin/python bench/sim_scale.py --requests 100000    # a slice; the JSON says which

Requests are drawn lazily (never a list): input and output lengths from a small table shaped
like the Azure conversation trace, Poisson arrivals at ``--rate-per-replica`` (default 0.7
requests/s per replica, the load of the 8-replica Azure run; least_request gives each arrival
to a replica with the fewest in flight, so few are ever idle: ~98 % busy). The fleet is one
pool of Llama-3.1-8B on H100-SXM, least_request routing, health checks on. Reports wall time,
peak RSS (``ru_maxrss``), kernel events per second and simulated seconds per wall second;
writes bench/results/sim_scale.json. The full run took 21 min and 6.1 GiB on a shared
2-core machine (docs/simulator.md, "Speed and scale").
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gpufleet.config import parse_fleet
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest

RESULT = Path(__file__).resolve().parent / "results" / "sim_scale.json"
LENGTHS = ((1020, 230), (300, 40), (2400, 350), (600, 120), (1500, 500), (120, 20))
"""(input, output) tokens: a few conversation-like shapes, drawn uniformly."""


def synthetic(n: int, rate: float, seed: int) -> Iterator[TraceRequest]:
    rng = random.Random(seed)
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        inp, out = LENGTHS[rng.randrange(len(LENGTHS))]
        yield TraceRequest(t, inp, out)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--rate-per-replica", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "gpu": "h100-sxm",
                    "replicas": args.replicas,
                    "routing": "least_request",
                }
            ]
        },
        source="bench",
    )
    rate = args.rate_per_replica * args.replicas
    build = time.perf_counter()
    sim = FleetSimulation(fleet, SimOptions(seed=args.seed, sample_interval=60.0))
    build = time.perf_counter() - build
    rss_built = peak_rss_mib()
    sim.start(synthetic(args.requests, rate, args.seed))
    wall = time.perf_counter()
    horizon = args.requests / rate
    for k in range(1, 21):
        sim.run(horizon * k / 20)
        print(
            f"{k * 5:3d}%  {sim.now:8.1f} sim s  {len(sim.harness.recorder.log):>9,} done  "
            f"{time.perf_counter() - wall:7.1f} s wall  {peak_rss_mib():7.0f} MiB",
            flush=True,
        )
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    report = sim.report({})
    result = {
        "command": "python bench/sim_scale.py " + " ".join(sys.argv[1:]),
        "replicas": args.replicas,
        "requests": args.requests,
        "arrival_rate_per_s": rate,
        "build_s": round(build, 2),
        "wall_s": round(wall, 1),
        "simulated_s": report["simulated_s"],
        "simulated_s_per_wall_s": round(report["simulated_s"] / wall, 3),
        "events": sim.events,
        "events_per_s": round(sim.events / wall),
        "requests_per_wall_s": round(args.requests / wall),
        "peak_rss_mib": round(peak_rss_mib()),
        "rss_after_build_mib": round(rss_built),
        "utilisation_mean": round(
            sum(r["utilisation"] for r in report["replicas"]) / len(report["replicas"]), 3
        ),
        "ttft_p50_s": report["overall"]["ttft_s"]["p50"],
        "e2e_p50_s": report["overall"]["e2e_s"]["p50"],
        "global_check": problems or "ok",
    }
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
