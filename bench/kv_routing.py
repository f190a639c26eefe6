"""Approximate vs precise prefix routing on a cache-heavy trace, in the fleet simulator.

    .venv/bin/python bench/kv_routing.py [--blocks default,8192] [--duration S] [--replicas 4]
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

``--blocks`` lists the KV caches to try, per replica, in 16-token blocks (``default``: what
the engine fits on the GPU, ~27k blocks for this model; 8,192 blocks is 131k tokens: the
engines evict, and the approximate index, sized for the default cache, remembers blocks
they have dropped).
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


def run(policy: str, blocks: int | None, args: argparse.Namespace) -> dict[str, Any]:
    model: dict[str, Any] = {"name": MODEL, "replicas": args.replicas, "routing": policy}
    if blocks is not None:
        model["args"] = ["--num-gpu-blocks-override", str(blocks)]
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
        "kv_blocks_per_replica": blocks or sim.harness.drivers[0].model.num_gpu_blocks,
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

    policies = list(dict.fromkeys(r["policy"] for r in runs))
    caches = list(dict.fromkeys(r["kv_blocks_per_replica"] for r in runs))
    width = 0.8 / len(policies)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for i, policy in enumerate(policies):
        mine = {r["kv_blocks_per_replica"]: r for r in runs if r["policy"] == policy}
        xs = [c + (i - (len(policies) - 1) / 2) * width for c in range(len(caches))]
        hits = [mine[c]["prefix_hit_rate"] * 100 for c in caches]
        bars = left.bar(xs, hits, width, label=policy, color=f"C{i}")
        left.bar_label(bars, fmt="%.1f", fontsize=8)
        p90 = [mine[c]["ttft_s"]["p90"] for c in caches]
        bars = right.bar(xs, p90, width, label=policy, color=f"C{i}")
        right.bar_label(bars, fmt="%.2f", fontsize=8)
    for axis in (left, right):
        axis.set_xticks(range(len(caches)), [f"{c:,} blocks / replica" for c in caches])
    left.set_ylabel("prefix-cache hit rate (%)")
    left.set_title("cached ÷ prompt tokens")
    left.legend(loc="upper right", fontsize=8)
    right.set_ylabel("TTFT P90 (s)")
    right.set_title("TTFT P90")
    fig.suptitle(title, fontsize=9)
    fig.savefig(PLOT, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--duration", type=float, default=None, help="trace seconds (all)")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--blocks", default="default,8192", help="KV caches per replica, in blocks (or default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    if not args.trace.is_file():
        sys.exit(f"{args.trace}: no such trace (the Mooncake conversation trace)")
    console = Console()
    runs = []
    for cache in args.blocks.split(","):
        blocks = None if cache == "default" else int(cache)
        for policy in args.policies.split(","):
            console.print(f"simulating {policy}, KV blocks {cache} …")
            runs.append(run(policy, blocks, args))
    table = Table(title=f"{args.replicas} × {MODEL} on H100, Mooncake conversation trace")
    columns = ("KV blocks", "policy", "hit rate", "TTFT P50", "TTFT P90", "TTFT P99", "matched")
    for column in (*columns, "wall"):
        table.add_column(column, justify="right")
    for r in runs:
        t = r["ttft_s"]
        table.add_row(
            f"{r['kv_blocks_per_replica']:,}",
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
        "kv_blocks": args.blocks,
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
