"""How many steps per second the replica model runs: it must not be a simulation's bottleneck.

    .venv/bin/python bench/replica_model_speed.py   # table + bench/results/replica_model_speed.json

Three workloads, each timed as plan_step + finish_step in a loop with virtual time (best and
median of ``--repeats`` runs; these machines are noisy):

* ``decode-256``: 256 requests decoding (the issue's figure of merit): 200-token prompts,
  ``ignore_eos``, measured once all 256 are past their prefill;
* ``mixed``: a closed loop of 256 requests: a new request replaces each one that finishes,
  half of them behind one of four shared 512-token system prompts, output lengths drawn by the
  model; so steps mix chunked prefills, prefix-cache hits and decodes;
* ``outputs-only`` (the baseline, same run): building the 256 ``RequestOutput`` objects a
  decode step returns and nothing else. The model's own share of a step is the rest;
* ``decode-256-fast``: the ``decode-256`` state fast-forwarded with ``run_decodes`` (the
  simulator's path for pure-decode runs: no plans, no outputs) over the same number of
  steps, timed per step. What is left is the step time and the KV blocks that 256 requests
  fill (one block per request every ``block_size`` steps, hashed for the prefix cache).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel, RequestOutput

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "replica_model_speed.json"
BATCH = 256


@dataclass
class Result:
    workload: str
    steps_per_s_best: float
    steps_per_s_median: float
    us_per_step: float
    """Best run."""
    us_plan: float
    us_finish: float
    tokens_per_step: float
    """Tokens (prefill + decode) the modelled GPU runs per step, mean."""
    modelled_s_per_wall_s: float
    """Modelled GPU seconds simulated per wall-clock second (best run)."""
    preemptions: int
    prefix_hit_rate: float


def _config(args: argparse.Namespace) -> ReplicaConfig:
    return ReplicaConfig(get_model(args.model), get_gpu(args.gpu), max_num_seqs=BATCH)


def _timed(model: ReplicaModel, steps: int, now: float, refill: _Refill | None) -> dict[str, float]:
    plan_s = finish_s = modelled = 0.0
    tokens = 0
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        plan = model.plan_step(now)
        t1 = clock()
        assert plan is not None
        now += plan.duration
        outputs = model.finish_step(plan, now)
        t2 = clock()
        plan_s += t1 - t0
        finish_s += t2 - t1
        modelled += plan.duration
        tokens += plan.batch.tokens
        if refill is not None:
            refill.replace_finished(model, outputs, now)
    return {"plan": plan_s, "finish": finish_s, "modelled": modelled, "tokens": tokens}


def _decoding(args: argparse.Namespace, repeat: int) -> tuple[ReplicaModel, float]:
    """A replica with 256 requests, all past their prefill; and the time."""
    model = ReplicaModel(_config(args))
    for i in range(BATCH):
        prompt = tuple(range(1000 + 300 * i, 1200 + 300 * i))
        model.add_request(NewRequest(f"d{repeat}-{i}", prompt, 4000, ignore_eos=True), 0.0)
    now = 0.0
    while True:  # until every request is decoding
        plan = model.plan_step(now)
        assert plan is not None
        now += plan.duration
        model.finish_step(plan, now)
        if plan.batch.decode_seqs == BATCH:
            return model, now


def decode_run(args: argparse.Namespace, repeat: int) -> tuple[dict[str, float], ReplicaModel]:
    model, now = _decoding(args, repeat)
    return _timed(model, args.steps, now, None), model


class _Refill:
    """Keeps 256 requests in the replica: each finished one is replaced by a new one."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.count = 0
        self.systems = [tuple(self.rng.randrange(vocab) for _ in range(512)) for _ in range(4)]

    def new(self) -> NewRequest:
        rng = self.rng
        user = tuple(
            rng.randrange(self.vocab) for _ in range(max(1, int(rng.lognormvariate(5.7, 0.8))))
        )
        prompt = (rng.choice(self.systems) + user if rng.random() < 0.5 else user)[:7000]
        self.count += 1
        return NewRequest(f"m{self.count}", prompt, max_tokens=1024)

    def replace_finished(
        self, model: ReplicaModel, outputs: list[RequestOutput], now: float
    ) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                model.add_request(self.new(), now)


def mixed_run(args: argparse.Namespace, repeat: int) -> tuple[dict[str, float], ReplicaModel]:
    model = ReplicaModel(_config(args))
    refill = _Refill(seed=repeat, vocab=model.config.model.vocab_size)
    for _ in range(BATCH):
        model.add_request(refill.new(), 0.0)
    now = 0.0
    for _ in range(200):  # warm up: past the first wave of prefills
        plan = model.plan_step(now)
        assert plan is not None
        now += plan.duration
        refill.replace_finished(model, model.finish_step(plan, now), now)
    return _timed(model, args.steps, now, refill), model


def outputs_only_run(args: argparse.Namespace, repeat: int) -> tuple[dict[str, float], None]:
    ids = [f"o{repeat}-{i}" for i in range(BATCH)]
    clock = time.perf_counter
    t0 = clock()
    for step in range(args.steps):
        outputs = [RequestOutput(rid, (step,), 200, 0, step + 1, None, False) for rid in ids]
    t1 = clock()
    del outputs
    return {"plan": 0.0, "finish": t1 - t0, "modelled": 0.0, "tokens": 0}, None


def decode_fast_run(args: argparse.Namespace, repeat: int) -> tuple[dict[str, float], ReplicaModel]:
    model, now = _decoding(args, repeat)
    # Stop after args.steps steps: a horizon just past the end of the last one.
    twin, _ = _decoding(args, repeat)
    run = twin.run_decodes(now, math.inf)
    assert run is not None
    assert run.num_steps >= args.steps
    end = now
    for duration in run.durations[: args.steps]:
        end += duration
    until = math.nextafter(end, math.inf)
    clock = time.perf_counter
    t0 = clock()
    fast = model.run_decodes(now, until)
    t1 = clock()
    assert fast is not None
    assert fast.num_steps == args.steps
    modelled = end - now
    return {
        "plan": t1 - t0,
        "finish": 0.0,
        "modelled": modelled,
        "tokens": BATCH * args.steps,
    }, model


WORKLOADS = {
    "decode-256": decode_run,
    "mixed": mixed_run,
    "outputs-only": outputs_only_run,
    "decode-256-fast": decode_fast_run,
}


def measure(name: str, args: argparse.Namespace) -> Result:
    runs = []
    model: ReplicaModel | None = None
    for repeat in range(args.repeats):
        timing, model = WORKLOADS[name](args, repeat)
        runs.append(timing)
    wall = [r["plan"] + r["finish"] for r in runs]
    best = runs[wall.index(min(wall))]
    steps = args.steps
    stats = model.stats() if model is not None else None
    return Result(
        workload=name,
        steps_per_s_best=steps / min(wall),
        steps_per_s_median=steps / statistics.median(wall),
        us_per_step=min(wall) / steps * 1e6,
        us_plan=best["plan"] / steps * 1e6,
        us_finish=best["finish"] / steps * 1e6,
        tokens_per_step=best["tokens"] / steps,
        modelled_s_per_wall_s=best["modelled"] / min(wall),
        preemptions=stats.num_preemptions if stats else 0,
        prefix_hit_rate=(
            stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats and stats.prefix_cache_queries
            else 0.0
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per workload")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    results = [measure(name, args) for name in WORKLOADS]
    floor = next(r for r in results if r.workload == "outputs-only")

    table = Table(title=f"replica model speed: {args.model} on {args.gpu}, batch {BATCH}")
    for column in (
        "workload",
        "steps/s",
        "median",
        "µs/step",
        "plan µs",
        "finish µs",
        "tok/step",
        "sim×",
        "hits",
        "outputs",
    ):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for r in results:
        share = floor.us_per_step / r.us_per_step if r.workload == "decode-256" else None
        table.add_row(
            r.workload,
            f"{r.steps_per_s_best:,.0f}",
            f"{r.steps_per_s_median:,.0f}",
            f"{r.us_per_step:,.0f}",
            f"{r.us_plan:,.0f}",
            f"{r.us_finish:,.0f}",
            f"{r.tokens_per_step:,.0f}" if r.tokens_per_step else "-",
            f"{r.modelled_s_per_wall_s:,.1f}" if r.modelled_s_per_wall_s else "-",
            f"{r.prefix_hit_rate:.0%}" if r.workload == "mixed" else "-",
            f"{share:.0%}" if share is not None else "-",
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a log: do not squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
    console.print(
        "steps/s: best of the runs; median: their median. sim×: modelled GPU seconds per wall "
        "second. hits: prefix-cache hit rate (tokens). outputs: the share of a decode step "
        "spent building its 256 RequestOutput objects (the outputs-only baseline, same run)."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(["python bench/replica_model_speed.py", *(argv or sys.argv[1:])]),
        "model": args.model,
        "gpu": args.gpu,
        "batch": BATCH,
        "steps": args.steps,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
