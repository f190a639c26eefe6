"""Approximate vs precise prefix routing on a cache-heavy trace, in the fleet simulator.

    .venv/bin/python bench/kv_routing.py [--duration 3600] [--rate-scale 1] [--replicas 4]
    # table + bench/results/kv_routing.{json,png}

The Mooncake FAST'25 conversation trace (``--trace``; 12,031 requests over 59 minutes,
``hash_ids`` are 512-token prefix blocks shared across a conversation's turns) is replayed
by ``FleetSimulation`` (what ``gpufleet simulate`` runs: the real pool controller, the
replica model's paged KV cache with prefix caching and eviction) on ``--replicas`` modelled
Llama-3.1-8B replicas on H100s, once per routing policy, same seed:

* ``round_robin``: no prefix knowledge (the floor);
* ``prefix_aware``: the approximate index of what the gateway routed where;
* ``prefix_precise``: the index the modelled engines' KV events keep (docs/kv-events.md),
  matched on the prompts' engine block hashes.

``--blocks`` overrides each replica's KV cache (in 16-token blocks) to add cache pressure.
Reported per policy: the prefix-cache hit rate (cached ÷ prompt tokens over the requests
served), TTFT P50 / P90 / P99, and the simulator's wall time (the precise run hashes every
prompt's engine blocks and applies every event batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpufleet.config import parse_fleet
from gpufleet.sim import FleetSimulation, SimOptions, load_trace

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "kv_routing.json"
PLOT = ROOT / "bench" / "results" / "kv_routing.png"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
MODEL = "llama-3.1-8b"
POLICIES = ("round_robin", "prefix_aware", "prefix_precise")


def run(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    model: dict[str, Any] = {"name": MODEL, "replicas": args.replicas, "routing": policy}
    if args.blocks is not None:
        model["args"] = ["--num-gpu-blocks-override", str(args.blocks)]
    fleet = parse_fleet({"models": [model], "gateway": {"seed": args.seed}})
    started = time.perf_counter()
    sim = FleetSimulation(fleet, SimOptions(seed=args.seed, sample_interval=10.0))
    sim.start(
        load_trace(args.trace, "mooncake", rate_scale=args.rate_scale, duration=args.duration)
    )
    sim.run()
    wall = time.perf_counter() - started
    report = sim.report({})
    overall = report["overall"]
    pool = sim.control.pools[MODEL]
    routed = pool.counters.routed
    out = {
        "policy": policy,
        "requests": overall["requests"],
        "prefix_hit_rate": overall["prefix_hit_rate"],
        "ttft_s": overall["ttft_s"],
        "e2e_s": overall["e2e_s"],
        "preemptions": overall["preemptions"],
        "mean_matched_blocks": pool.counters.matched_blocks / routed if routed else 0.0,
        "simulated_s": report["simulated_s"],
        "wall_s": round(wall, 1),
        "digest": report["digest"],
    }
    feeds = getattr(pool.router.snapshot(), "feeds", None)
    if feeds is not None:
        out["kv_batches_applied"] = sum(f.applied for f in feeds.values())
        out["kv_blocks_indexed"] = {r: f.blocks for r, f in feeds.items()}
    return out


def plot(runs: list[dict[str, Any]], title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["policy"] for r in runs]
    colors = [f"C{i}" for i in range(len(runs))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    bars = left.bar(names, [r["prefix_hit_rate"] * 100 for r in runs], color=colors)
    left.bar_label(bars, fmt="%.1f %%")
    left.set_ylabel("prefix-cache hit rate (%)")
    left.set_title("cached ÷ prompt tokens")
    p90 = [r["ttft_s"]["p90"] for r in runs]
    p50 = [r["ttft_s"]["p50"] for r in runs]
    bars = right.bar(names, p90, color=colors, label="P90")
    right.bar_label(bars, fmt="%.2f s")
    right.scatter(names, p50, color="black", marker="_", s=400, label="P50", zorder=3)
    right.set_ylabel("TTFT (s)")
    right.set_title("TTFT P90 (bar) and P50 (line)")
    right.legend(loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.savefig(PLOT, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--duration", type=float, default=None, help="trace seconds (all)")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=None, help="KV blocks per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    if not args.trace.is_file():
        sys.exit(f"{args.trace}: no such trace (the Mooncake conversation trace)")
    console = Console()
    runs = []
    for policy in args.policies.split(","):
        console.print(f"simulating {policy} …")
        runs.append(run(policy, args))
    table = Table(title=f"{args.replicas} × {MODEL} on H100, Mooncake conversation trace")
    for column in ("policy", "hit rate", "TTFT P50", "TTFT P90", "TTFT P99", "matched", "wall"):
        table.add_column(column, justify="right")
    for r in runs:
        t = r["ttft_s"]
        table.add_row(
            r["policy"],
            f"{r['prefix_hit_rate'] * 100:.2f} %",
            f"{t['p50']:.3f} s",
            f"{t['p90']:.3f} s",
            f"{t['p99']:.3f} s",
            f"{r['mean_matched_blocks']:.1f}",
            f"{r['wall_s']:.0f} s",
        )
    console.print(table)
    command = "python bench/kv_routing.py " + " ".join(sys.argv[1:])
    result = {
        "command": command.strip(),
        "trace": args.trace.name,
        "duration": args.duration,
        "rate_scale": args.rate_scale,
        "replicas": args.replicas,
        "kv_blocks_per_replica": args.blocks,
        "seed": args.seed,
        "python": platform.python_version(),
        "runs": runs,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, f"{args.replicas} × {MODEL}/H100, Mooncake conversation trace ({command})")
    console.print(f"wrote {RESULT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
