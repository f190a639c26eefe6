"""Batch lines on spare capacity, live: interactive TTFT P99 beside a batch, and the share of
the fleet's idle capacity the batch uses (issue 17).

    PYTHONPATH=src:. .venv/bin/python bench/batch_spare_capacity.py   # ~5 min on 2 cores
    ... --targets 0.9 --recall on --margin none,0.1   # the TTFT guard (ttft_margin) beside

Two sim replicas (``gpufleet engine sim`` processes, ``--max-num-seqs 16``, time scale
0.25) behind the gateway with auth on, every request of one shape (100-word prompt, 48
answer tokens). The harness (``tests/gateway/batch_spare_live.py``):

1. capacity: a batch alone, no gate, twice the slots offered: lines completed per second;
2. interactive alone at 50 % of that (Poisson, streamed, TTFT at the client), gate on;
3. the same interactive plan beside a 5,000-line batch, once per gate setting (``target``:
   the share of the slots batch lines fill up to; ``recall``: whether an interactive request
   that finds its replica full takes a running line's slot back); the batch's lines per
   second while the interactive plan runs, against the idle capacity (capacity −
   interactive throughput);
4. interactive alone again: how far two equal runs' P99 differ on this machine.

The bar: TTFT P99 with the batch within 10 % of alone, batch ≥ 70 % of the idle capacity.
Writes ``bench/results/batch_spare_capacity.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tests.gateway.batch_spare_live import run_spare

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "batch_spare_capacity.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--targets", default="0.8,0.9,1.0")
    parser.add_argument("--recall", default="on,off", help="recall settings to run: on, off")
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--margin", default="none", help="ttft_margin settings to run: none, or a share"
    )
    args = parser.parse_args()
    targets = [float(t) for t in args.targets.split(",")]
    recalls = [r.strip() == "on" for r in args.recall.split(",")]
    margins = [None if m.strip() == "none" else float(m) for m in args.margin.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_spare(
            Path(tmp),
            duration=args.duration,
            lines=args.lines,
            time_scale=args.time_scale,
            spares=tuple(
                {"target": t, "recall": r, "ttft_margin": m}
                for m in margins
                for r in recalls
                for t in targets
            ),
            seed=args.seed,
        )
    show(result)
    out = RESULT if margins == [None] else RESULT.with_stem(RESULT.stem + "_ttft_guard")
    plot(result, out.with_suffix(".png"))
    for run in result["with_batch"]:
        run["series"] = run["series"][::10]  # every 0.2 s in the JSON; the plot has all
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def show(result: dict[str, Any]) -> None:
    console = Console()
    console.print(
        f"capacity {result['capacity_rps']} lines/s; interactive {result['interactive_rate_rps']}"
        f" req/s offered, {result['interactive_served_rps']} served; idle"
        f" {result['idle_capacity_rps']} req/s"
    )
    alone = result["interactive_alone"]
    console.print(
        f"interactive alone: TTFT P99 {alone[0]['ttft_ms']['p99']} ms; again at the end:"
        f" {alone[-1]['ttft_ms']['p99']} ms (ratio {result['alone_again_p99_ratio']})"
    )
    table = Table(title="interactive at 50 % + a batch, by gate target")
    columns = ("recall", "target", "margin", "TTFT P50 ms", "TTFT P99 ms", "P99 ratio", "batch/s",
               "share of idle", "recalled")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for run in result["with_batch"]:
        ttft = run["interactive"]["ttft_ms"]
        table.add_row(
            "on" if run["spare"]["recall"] else "off",
            f"{run['spare']['target']:.2f}",
            str(run["spare"]["ttft_margin"]),
            str(ttft["p50"]),
            str(ttft["p99"]),
            str(run["ttft_p99_ratio"]),
            str(run["batch_rps"]),
            str(run["batch_share_of_idle"]),
            str(run["recalled"]),
        )
    console.print(table)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the bench draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs = result["with_batch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        recall = "recall" if run["spare"]["recall"] else "no recall"
        margin = run["spare"]["ttft_margin"]
        label = f"target {run['spare']['target']:.2f}, {recall}" + (
            f", margin {margin}" if margin is not None else ""
        )
        point = left.scatter(run["batch_share_of_idle"], run["ttft_p99_ratio"], s=50)
        left.annotate(label, (run["batch_share_of_idle"], run["ttft_p99_ratio"]), fontsize=8)
        rows = run["series"]
        right.plot(
            [r[0] for r in rows], [r[2] for r in rows], label=f"batch in flight, {label}",
            color=point.get_facecolor()[0],
        )  # fmt: skip
    left.axhline(1.10, color="grey", linestyle="--", linewidth=1)
    left.axvline(0.70, color="grey", linestyle="--", linewidth=1)
    left.axhline(result["alone_again_p99_ratio"], color="tab:red", linestyle=":", linewidth=1)
    left.set_xlabel("batch lines/s ÷ idle capacity")
    left.set_ylabel("interactive TTFT P99, with batch ÷ alone")
    left.set_title("the bar: right of 0.70, below 1.10 (dotted: alone ÷ alone)")
    last = runs[-1]["series"]
    right.plot([r[0] for r in last], [r[1] for r in last], color="black", linewidth=0.7,
               label="all in flight (last target)")  # fmt: skip
    right.axhline(result["slots"], color="grey", linestyle="--", linewidth=1)
    right.set_xlabel("seconds into the interactive plan")
    right.set_ylabel("requests")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
