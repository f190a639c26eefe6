"""Fairness under a 10× heavy tenant, in simulation: the gateway's FairQueue vs FIFO.

    .venv/bin/python bench/fairness.py          # table + bench/results/fairness.{json,png}

Two tenants of equal weight and class send the same request mix (Poisson arrivals, prompts
500-1,500 tokens, outputs 100-300): ``light`` at ``--light-rate`` req/s, ``heavy`` at 10×
that, more than the fleet can serve. ``FleetSimulation`` (what ``gpufleet simulate`` runs)
replays five runs on the same fleet (``--replicas`` Llama-3.1-8B replicas on H100-SXM,
``--max-num-seqs``, least-request routing) and seed:

* ``light alone`` and ``heavy alone`` with admission on (the heavy tenant alone queues:
  the fleet is saturated by it);
* ``light + heavy`` with admission on: the gateway's ``FairQueue`` (VTC fair share) in
  front of routing, queueing at ``--saturation``, with the fair-share reserve up to
  ``reserve_saturation`` (default 1.0) for a tenant whose demand fits its share;
* ``light alone (FIFO)`` and ``light + heavy (FIFO)``: admission off, every request goes
  straight to a replica, whose queue is first come first served.

The bar (issue 7): the light tenant's TTFT P99 with the heavy tenant within 2× of alone, with
fair queuing. The FIFO pair is the contrast.

``--live`` runs the same experiment over real HTTP instead (``tests/gateway/fairness_live.py``):
two sim replicas (``--live-max-num-seqs`` 16, time scale 1) behind the gateway with auth on,
two tenants' keys from a real SQLite store, the light tenant alone, then beside the heavy
one (3 and 30 req/s of 200-token answers: more than the gated pool, and than the engines,
serve, so the heavy tenant queues), three ways: fair queue + reserve, fair queue alone, no
gateway queue (FIFO in the engines); it writes ``fairness_live.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.sim import FleetSimulation, SimOptions, SimTenant, TraceRequest

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "fairness.json"
BAR = 2.0


def fleet(replicas: int, seqs: int, saturation: float, *, admission: bool) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "gpu": "h100-sxm",
                    "replicas": replicas,
                    "args": [f"--max-num-seqs={seqs}"],
                    "routing": "least_request",
                }
            ],
            "gateway": {"scrape_interval": 0.2},
            "tenants": {
                "auth": admission,
                "admission": {"saturation": saturation},
            },
        }
    )


def stream(tenant: str, rate: float, duration: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` for ``duration`` s; every tenant draws the same mix."""
    rng = random.Random(f"fairness-{tenant}-{seed}")
    t, out = 0.0, []
    while (t := t + rng.expovariate(rate)) < duration:
        out.append(TraceRequest(t, rng.randint(500, 1500), rng.randint(100, 300), tenant=tenant))
    return out


def simulate(config: FleetConfig, requests: list[TraceRequest], seed: int) -> dict[str, Any]:
    sim = FleetSimulation(
        config, SimOptions(seed=seed, tenants=(SimTenant("light"), SimTenant("heavy")))
    )
    sim.start(sorted(requests, key=lambda r: r.arrival_s))
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    assert not problems, problems
    report = sim.report({})
    return {
        "wall_s": round(wall, 2),
        "simulated_s": report["simulated_s"],
        "throughput_rps": report["overall"]["throughput"]["requests_per_s"],
        "tenants": report["tenants"]["tenants"],
        "queue_max": report["tenants"]["admission"]["queue_max"],
    }


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else round(num / den, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--saturation", type=float, default=0.5)
    parser.add_argument("--light-rate", type=float, default=60.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--live", action="store_true", help="over real HTTP, not simulated")
    parser.add_argument("--live-replicas", type=int, default=2)
    parser.add_argument("--live-max-num-seqs", type=int, default=16)
    parser.add_argument("--live-saturation", type=float, default=0.5)
    parser.add_argument("--live-tokens", type=int, default=200)
    parser.add_argument("--live-light-rate", type=float, default=3.0)
    parser.add_argument("--live-duration", type=float, default=20.0)
    args = parser.parse_args()
    if args.live:
        live(args)
        return
    light = stream("light", args.light_rate, args.duration, args.seed)
    heavy = stream("heavy", 10 * args.light_rate, args.duration, args.seed)
    on = fleet(args.replicas, args.max_num_seqs, args.saturation, admission=True)
    off = fleet(args.replicas, args.max_num_seqs, args.saturation, admission=False)
    runs = {
        "light alone": (on, light),
        "heavy alone": (on, heavy),
        "light + heavy": (on, light + heavy),
        "light alone (FIFO)": (off, light),
        "light + heavy (FIFO)": (off, light + heavy),
    }
    results: dict[str, Any] = {}
    for name, (config, requests) in runs.items():
        results[name] = simulate(config, requests, args.seed)
        print(f"{name}: {results[name]['wall_s']} s wall", flush=True)

    def p99(run: str, tenant: str) -> float | None:
        value: float | None = results[run]["tenants"][tenant]["ttft_s"]["p99"]
        return value

    fair = ratio(p99("light + heavy", "light"), p99("light alone", "light"))
    fifo = ratio(p99("light + heavy (FIFO)", "light"), p99("light alone (FIFO)", "light"))
    heavy_alone = results["heavy alone"]
    summary = {
        "light_ttft_p99_ratio_fair": fair,
        "light_ttft_p99_ratio_fifo": fifo,
        "bar": BAR,
        "passes": fair is not None and fair <= BAR,
        "heavy_offered_rps": round(len(heavy) / args.duration, 2),
        "heavy_alone_served_rps": heavy_alone["throughput_rps"],
        "heavy_alone_queued": heavy_alone["tenants"]["heavy"]["queued"],
        "saturated": heavy_alone["tenants"]["heavy"]["queued"] > 0,
    }
    table = Table(title="light tenant's TTFT, alone and beside a 10× heavy tenant (simulated)")
    for column in ("run", "tenant", "requests", "shed", "TTFT p50 ms", "TTFT p99 ms", "wait p99"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, result in results.items():
        for tenant, t in result["tenants"].items():
            ms = [
                "—" if v is None else f"{v * 1000:,.1f}"
                for v in (t["ttft_s"]["p50"], t["ttft_s"]["p99"], t["queue_wait_s"]["p99"])
            ]
            table.add_row(name, tenant, f"{t['requests']:,}", f"{t['shed'] + t['expired']:,}", *ms)
    console = Console()
    console.print(table)
    console.print(
        f"light TTFT P99 with heavy / alone: fair queuing {fair}× (bar ≤ {BAR}), FIFO {fifo}×; "
        f"heavy offered {summary['heavy_offered_rps']} req/s, served alone "
        f"{summary['heavy_alone_served_rps']} req/s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "command": "python bench/fairness.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "inputs": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "runs": results,
    }
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    plot(results, summary, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


LIVE_RUNS = {
    "fair + reserve": {},
    "fair, no reserve": {"reserve_saturation": 0.0},
    "FIFO (no gateway queue)": {"saturation": 1000.0, "reserve_saturation": 0.0},
}
"""The live setups compared: the gateway's admission as configured (``--saturation`` and the
fair-share reserve up to ``reserve_saturation`` 1.0); the same without the reserve (a light
request waits for a slot at the head of the fair queue); no gateway queue at all (every
request goes to an engine, whose queue is first come first served)."""


def live(args: argparse.Namespace) -> None:
    import sys  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    sys.path.insert(0, str(ROOT))  # tests.gateway: the live harness
    from tests.gateway.fairness_live import run_live  # noqa: PLC0415 - the live harness

    results: dict[str, Any] = {}
    for name, overrides in LIVE_RUNS.items():
        settings: dict[str, Any] = {
            "light_rate": args.live_light_rate,
            "duration": args.live_duration,
            "replicas": args.live_replicas,
            "max_num_seqs": args.live_max_num_seqs,
            "saturation": args.live_saturation,
            "tokens": args.live_tokens,
            "seed": args.seed,
            **overrides,
        }
        with tempfile.TemporaryDirectory() as tmp:
            results[name] = run_live(Path(tmp), **settings)
        print(f"{name}: light TTFT P99 ratio {results[name]['light_ttft_p99_ratio']}", flush=True)
    table = Table(title="light tenant's TTFT over HTTP, alone and beside a 10× heavy tenant")
    for column in (
        "setup",
        "run",
        "served",
        "statuses",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "gate queue max",
    ):
        table.add_column(column)
    for setup, result in results.items():
        for name, gate in (
            ("light_alone", "alone"),
            ("light_with_heavy", "with_heavy"),
            ("heavy_with_light", "with_heavy"),
        ):
            r = result[name]
            table.add_row(
                setup,
                name,
                str(r["served"]),
                str(r["statuses"]),
                str(r["ttft_ms"]["p50"]),
                str(r["ttft_ms"]["p99"]),
                str(result["gate"][gate]["queue_max"]),
            )
    console = Console()
    console.print(table)
    ratios = {name: r["light_ttft_p99_ratio"] for name, r in results.items()}
    console.print(f"light TTFT P99 with heavy / alone (live): {ratios} (bar ≤ {BAR})")
    out = args.out.with_name("fairness_live.json")
    data = {
        "command": "python bench/fairness.py --live "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k.startswith("live_") or k == "seed"
        ),
        "summary": {
            "light_ttft_p99_ratio": ratios,
            "bar": BAR,
            "passes": (ratios["fair + reserve"] or 99) <= BAR,
        },
        "runs": results,
    }
    out.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {out}")


def plot(results: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the bench draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = ["light alone", "light + heavy", "light alone (FIFO)", "light + heavy (FIFO)"]
    p50 = [results[n]["tenants"]["light"]["ttft_s"]["p50"] * 1000 for n in names]
    p99 = [results[n]["tenants"]["light"]["ttft_s"]["p99"] * 1000 for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="P50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="P99")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_ylabel("light tenant TTFT (ms, log)")
    ax.set_title(
        f"light TTFT P99 with/without a 10× heavy tenant: fair "
        f"{summary['light_ttft_p99_ratio_fair']}×, FIFO {summary['light_ttft_p99_ratio_fifo']}×"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
