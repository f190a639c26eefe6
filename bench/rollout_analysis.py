"""How often a rollout's analysis is wrong: false rollbacks of an equal version, and how soon
a slower or error-prone one is caught, over many seeded runs of the pure policy.

    .venv/bin/python bench/rollout_analysis.py               # 1,000 seeds per case
    .venv/bin/python bench/rollout_analysis.py --seeds 200   # quicker; the JSON says which
    .venv/bin/python bench/rollout_analysis.py --per-window 200 \
        --out bench/results/rollout_analysis_thin.json       # a thin canary: 10 at 5 %

Each run is a canary 5 → 20 → 50 → 100 % with the default analysis (``min_samples`` 30,
``alpha`` 0.001, tolerances 1.5× on the P99s, 2 points on the error rate) and 800 requests
a window split by the step's share: lognormal TTFT (median 0.2 s, σ 0.6: a heavy tail) and
ITL (median 20 ms, σ 0.3), and a 2 % error rate on both sides unless the case says
otherwise. A case is a version ``slow``× slower or with ``errors`` of its requests failing.
Reports, per case, the share of runs promoted to 100 % and of those rolled back, the mean
window at which a rollback came and the mean windows a promotion took (the three steps
take three; a hold adds one); writes bench/results/rollout_analysis.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from gpufleet.policy import AnalysisConfig, Rollout, RolloutConfig, RolloutPhase

RESULT = Path(__file__).resolve().parent / "results" / "rollout_analysis.json"
CASES = (
    ("equal", 1.0, 0.02),
    ("1.2x slower", 1.2, 0.02),
    ("1.5x slower", 1.5, 0.02),
    ("2x slower", 2.0, 0.02),
    ("3x slower", 3.0, 0.02),
    ("10 % errors", 1.0, 0.10),
)
PER_WINDOW = 800


def feed(
    rollout: Rollout, rng: random.Random, n: int, pool: str, *, slow: float, errors: float
) -> None:
    ttft, itl = [], []
    for _ in range(n):
        error = rng.random() < errors
        rollout.outcome(pool, error=error)
        if not error:
            ttft.append(slow * rng.lognormvariate(-1.6, 0.6))
            itl.append(slow * rng.lognormvariate(-3.9, 0.3))
    rollout.latencies(pool, ttft, itl)


def run(seed: int, slow: float, errors: float, per_window: int) -> tuple[RolloutPhase, int]:
    """One canary: how it ended, after how many analysed windows."""
    rng = random.Random(seed)
    config = RolloutConfig(to="v2", steps=(5, 20, 50, 100), step_seconds=10.0)
    assert config.analysis == AnalysisConfig()
    rollout = Rollout("chat", config, {"v1": 100.0, "v2": 0.0}, now=0.0)
    rollout.begin(0.0)
    t, windows = 0.0, 0
    while rollout.phase is RolloutPhase.RUNNING:
        share = rollout.share / 100
        feed(rollout, rng, round(per_window * (1 - share)), "v1", slow=1.0, errors=0.02)
        feed(rollout, rng, round(per_window * share), "v2", slow=slow, errors=errors)
        t += 10.0
        windows += 1
        rollout.decide(t, {})
    return rollout.phase, windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--per-window", type=int, default=PER_WINDOW, help="requests")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    print(
        f"{'case':<14} {'promoted':>9} {'rolled back':>12} {'rollback at':>12} {'promoted in':>12}"
    )
    for name, slow, errors in CASES:
        ends = [run(seed, slow, errors, args.per_window) for seed in range(args.seeds)]
        back = [w for phase, w in ends if phase is RolloutPhase.ROLLED_BACK]
        promoted = [w for phase, w in ends if phase is RolloutPhase.PROMOTED]
        row = {
            "case": name,
            "slow": slow,
            "error_rate": errors,
            "promoted": len(promoted) / args.seeds,
            "rolled_back": len(back) / args.seeds,
            "mean_rollback_window": sum(back) / len(back) if back else None,
            "mean_promotion_windows": sum(promoted) / len(promoted) if promoted else None,
        }
        rows.append(row)
        window = "-" if not back else f"{row['mean_rollback_window']:.2f}"
        took = "-" if not promoted else f"{row['mean_promotion_windows']:.2f}"
        print(
            f"{name:<14} {row['promoted']:>9.1%} {row['rolled_back']:>12.1%} {window:>12}"
            f" {took:>12}"
        )
    result = {
        "command": " ".join(["bench/rollout_analysis.py", *sys.argv[1:]]),
        "seeds": args.seeds,
        "requests_per_window": args.per_window,
        "analysis": AnalysisConfig().model_dump(),
        "cases": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
