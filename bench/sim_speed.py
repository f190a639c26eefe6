"""How fast the fleet simulator replays a real trace: the issue's speed bar, measured.

    .venv/bin/python bench/sim_speed.py    # table + bench/results/sim_speed.json

The full Azure LLM 2023 conversation trace (19,366 requests over one hour) on 8 replicas of
Llama-3.1-8B on H100-SXM, routed round robin, on one core. The bar: under 60 s of wall time.
Three parts, in this order (peak RSS is a process-wide maximum, so the speed run comes first):

* ``speed``: wall time, simulated seconds per wall second, kernel events and replica steps
  per second, peak RSS, and the run's latencies and digest;
* ``coalescing``: the same run again, instrumented, counting the steps a pure-decode
  fast-forward could take in bulk (no prefill, nothing waiting, no first or last token, no
  arrival before the step ends); it checks that such steps' durations follow from the
  previous step's batch, and estimates the wall time with the fast-forward;
* ``memory``: a synthetic million-request trace: bytes per ``TraceRequest`` held in a list,
  and the peak while streaming it (tracemalloc).

The trace is read from ``../shared/traces`` (beside the clone) or ``--trace``.
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import json
import os
import platform
import pstats
import resource
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel, RequestOutput, StepPlan
from gpufleet.perf import BatchShape
from gpufleet.sim import FleetHarness, LogHistogram, PromptBuilder, TraceRequest, load_trace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
DEFAULT_OUT = REPO / "bench" / "results" / "sim_speed.json"
BAR_WALL_S = 60.0
SLICE_S = 20.0
"""Simulated seconds between progress-bar updates."""


@dataclass
class Speed:
    requests: int
    replicas: int
    wall_s: float
    sim_s: float
    sim_s_per_wall_s: float
    events: int
    events_per_s: float
    steps: int
    steps_per_s: float
    us_per_step: float
    peak_rss_mib: float
    mean_busy: float
    """Mean fraction of simulated time the replicas spent in steps."""
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    itl_mean_s: float
    itl_p50_s: float
    itl_p99_s: float
    digest: str


@dataclass
class Coalescing:
    steps: int
    regular_steps: int
    """Steps that must stay plan_step + finish_step calls."""
    coalescible_steps: int
    runs: int
    """Maximal sequences of coalescible steps on one replica (one fast-forward call each)."""
    mean_run_steps: float
    duration_mismatches: int
    """Coalescible steps whose duration differs from step_time(seqs, previous context + seqs)."""
    us_per_fast_step: float
    """Measured: one step's duration and bookkeeping inside a fast-forward."""
    estimated_wall_s: float
    """regular_steps × measured µs/step + coalescible × µs/fast step + runs × µs/step."""


@dataclass
class Memory:
    requests: int
    bytes_per_request_in_a_list: float
    streaming_peak_kib: float
    read_s: float


def _replicas(args: argparse.Namespace) -> list[ReplicaModel]:
    config = ReplicaConfig(get_model(args.model), get_gpu(args.gpu))
    return [ReplicaModel(config) for _ in range(args.replicas)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def run_speed(args: argparse.Namespace, console: Console) -> Speed:
    last = 0.0
    for request in load_trace(args.trace, duration=args.duration):
        last = request.arrival_s
    model = get_model(args.model)
    harness = FleetHarness(_replicas(args), PromptBuilder(model.vocab_size))
    reader = load_trace(args.trace, duration=args.duration)
    harness.start(reader)
    kernel = harness.kernel
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} sim s"),
        TextColumn("{task.fields[requests]:,} requests done"),
        TimeElapsedColumn(),
    )
    start = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("simulating", total=last, requests=0)
        until = 0.0
        while kernel.peek() < last:
            until = min(until + SLICE_S, last)
            kernel.run(until)
            progress.update(task, completed=until, requests=len(harness.recorder.log))
        kernel.run()
        progress.update(task, completed=last, requests=len(harness.recorder.log))
    wall = time.perf_counter() - start
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    records = [r for r in harness.recorder.log if not r.rejected]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    e2e = [r.e2e_s for r in records]
    itl: LogHistogram = harness.recorder.itl
    steps = sum(d.steps for d in harness.drivers)
    return Speed(
        requests=reader.requests,
        replicas=args.replicas,
        wall_s=wall,
        sim_s=kernel.now,
        sim_s_per_wall_s=kernel.now / wall,
        events=kernel.events_processed,
        events_per_s=kernel.events_processed / wall,
        steps=steps,
        steps_per_s=steps / wall,
        us_per_step=wall / steps * 1e6,
        peak_rss_mib=rss_mib,
        mean_busy=sum(d.busy_s for d in harness.drivers) / len(harness.drivers) / kernel.now,
        ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p99_s=_quantile(ttft, 0.99),
        e2e_p50_s=_quantile(e2e, 0.5),
        e2e_p99_s=_quantile(e2e, 0.99),
        itl_mean_s=itl.mean or 0.0,
        itl_p50_s=itl.quantile(0.5) or 0.0,
        itl_p99_s=itl.quantile(0.99) or 0.0,
        digest=harness.recorder.digest(),
    )


class _Watched:
    """A ReplicaModel seen through its public API: classifies every step it finishes."""

    def __init__(self, model: ReplicaModel, arrivals: list[float], tally: dict[str, int]) -> None:
        self.model = model
        self.arrivals = arrivals
        self.tally = tally
        self.started: dict[int, float] = {}
        self.previous: BatchShape | None = None
        """The batch of the previous step, when it was coalescible (a run is going on)."""

    def add_request(self, request: NewRequest, now: float) -> None:
        self.model.add_request(request, now)

    def plan_step(self, now: float) -> StepPlan | None:
        plan = self.model.plan_step(now)
        if plan is not None:
            self.started[plan.step] = now
        return plan

    def finish_step(self, plan: StepPlan, now: float) -> list[RequestOutput]:
        start = self.started.pop(plan.step)
        waiting = self.model.stats().num_waiting
        outputs = self.model.finish_step(plan, now)
        batch = plan.batch
        arrival = bisect.bisect_right(self.arrivals, start)
        arrived = arrival < len(self.arrivals) and self.arrivals[arrival] <= now
        plain = (
            batch.prefill_tokens == 0
            and not waiting
            and not arrived
            and not any(o.first_token or o.finish_reason is not None for o in outputs)
        )
        tally = self.tally
        tally["steps"] += 1
        if not plain:
            tally["regular"] += 1
            self.previous = None
            return outputs
        tally["coalescible"] += 1
        previous = self.previous
        if previous is None or previous.decode_seqs != batch.decode_seqs:
            tally["runs"] += 1
        else:  # inside a run the next batch follows from the previous one
            predicted = BatchShape(
                decode_seqs=batch.decode_seqs,
                decode_context=previous.decode_context + batch.decode_seqs,
            )
            seconds = self.model.step_time_model.step_time(predicted).seconds
            if predicted != batch or seconds * self.model.slowdown != plan.duration:
                tally["mismatches"] += 1
        self.previous = batch
        return outputs


def _fast_step_us(args: argparse.Namespace, seqs: int = 2, steps: int = 200_000) -> float:
    """µs for one step inside a fast-forward: its duration, the clock, one histogram add."""
    model = ReplicaModel(ReplicaConfig(get_model(args.model), get_gpu(args.gpu)))
    step_time = model.step_time_model.step_time
    itl = LogHistogram()
    context, now = 2_000, 0.0
    start = time.perf_counter()
    for _ in range(steps):
        batch = BatchShape(decode_seqs=seqs, decode_context=context)
        end = now + step_time(batch).seconds
        itl.add(end - now, seqs)
        now = end
        context += seqs
    return (time.perf_counter() - start) / steps * 1e6


def run_coalescing(args: argparse.Namespace, speed: Speed) -> Coalescing:
    arrivals = [r.arrival_s for r in load_trace(args.trace, duration=args.duration)]
    tally = dict.fromkeys(("steps", "regular", "coalescible", "runs", "mismatches"), 0)
    watched: list[Any] = [_Watched(m, arrivals, tally) for m in _replicas(args)]
    harness = FleetHarness(watched, PromptBuilder(get_model(args.model).vocab_size))
    harness.start(load_trace(args.trace, duration=args.duration))
    harness.run()
    fast_us = _fast_step_us(args)
    runs = tally["runs"]
    return Coalescing(
        steps=tally["steps"],
        regular_steps=tally["regular"],
        coalescible_steps=tally["coalescible"],
        runs=runs,
        mean_run_steps=tally["coalescible"] / runs if runs else 0.0,
        duration_mismatches=tally["mismatches"],
        us_per_fast_step=fast_us,
        estimated_wall_s=(
            (tally["regular"] + runs) * speed.us_per_step + tally["coalescible"] * fast_us
        )
        / 1e6,
    )


def run_memory(requests: int) -> Memory:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "million.csv"
        with path.open("w") as file:
            file.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
            for i in range(requests):
                seconds, fraction = divmod(i * 3_600_000_000 // requests, 1_000_000)
                minutes, second = divmod(seconds, 60)
                hours, minute = divmod(minutes, 60)
                stamp = f"2024-05-10 {hours:02d}:{minute:02d}:{second:02d}.{fraction:06d}0"
                file.write(f"{stamp},{300 + i % 4000},{20 + i % 700}\n")
        start = time.perf_counter()
        count = sum(1 for _ in load_trace(path))
        read_s = time.perf_counter() - start
        assert count == requests
        tracemalloc.start()
        for _ in load_trace(path):
            pass
        _, streaming_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        held: list[TraceRequest] = list(load_trace(path))
        after, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del held
    return Memory(
        requests=requests,
        bytes_per_request_in_a_list=(after - before) / requests,
        streaming_peak_kib=streaming_peak / 1024,
        read_s=read_s,
    )


def profile(args: argparse.Namespace, console: Console) -> None:
    model = get_model(args.model)
    harness = FleetHarness(_replicas(args), PromptBuilder(model.vocab_size))
    harness.start(load_trace(args.trace, duration=args.profile))
    profiler = cProfile.Profile()
    profiler.runcall(harness.run)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    console.print(f"[bold]cProfile, first {args.profile:.0f} simulated seconds, by own time")
    stats.sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--duration", type=float, default=None, help="simulate a prefix (s)")
    parser.add_argument("--no-coalescing", action="store_true", help="skip the second run")
    parser.add_argument("--memory-requests", type=int, default=1_000_000)
    parser.add_argument("--profile", type=float, default=None, metavar="S", help="cProfile S s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    if not args.trace.exists():
        console.print(f"[red]{args.trace} is not here; pass --trace")
        return 2
    if args.profile:
        profile(args, console)
        return 0

    speed = run_speed(args, console)
    coalescing = None if args.no_coalescing else run_coalescing(args, speed)
    memory = run_memory(args.memory_requests) if args.memory_requests else None

    table = Table(title=f"fleet simulator: {args.trace.name}, {args.replicas} × {args.model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{speed.requests:,}"),
        ("wall time", f"{speed.wall_s:,.1f} s  (bar < {BAR_WALL_S:.0f} s)"),
        ("simulated", f"{speed.sim_s:,.0f} s"),
        ("sim s / wall s", f"{speed.sim_s_per_wall_s:,.1f}"),
        ("events / s", f"{speed.events_per_s:,.0f}  ({speed.events:,})"),
        ("steps / s", f"{speed.steps_per_s:,.0f}  ({speed.steps:,}, {speed.us_per_step:.1f} µs)"),
        ("peak RSS", f"{speed.peak_rss_mib:,.0f} MiB"),
        ("replica busy", f"{speed.mean_busy:.0%}"),
        ("TTFT p50 / p99", f"{speed.ttft_p50_s * 1e3:.1f} / {speed.ttft_p99_s * 1e3:.1f} ms"),
        ("E2E p50 / p99", f"{speed.e2e_p50_s:.2f} / {speed.e2e_p99_s:.2f} s"),
        ("ITL p50 / p99", f"{speed.itl_p50_s * 1e3:.2f} / {speed.itl_p99_s * 1e3:.2f} ms"),
    ]
    if coalescing is not None:
        share = coalescing.coalescible_steps / coalescing.steps
        rows += [
            ("coalescible steps", f"{share:.0%} in {coalescing.runs:,} runs"),
            ("mean run", f"{coalescing.mean_run_steps:.1f} steps"),
            ("duration mismatches", f"{coalescing.duration_mismatches:,}"),
            ("µs per fast step", f"{coalescing.us_per_fast_step:.2f}"),
            ("est. wall, fast-forward", f"{coalescing.estimated_wall_s:,.1f} s"),
        ]
    if memory is not None:
        rows += [
            ("TraceRequest in a list", f"{memory.bytes_per_request_in_a_list:.0f} B/request"),
            ("streaming peak", f"{memory.streaming_peak_kib:,.0f} KiB"),
            (f"reading {memory.requests:,} rows", f"{memory.read_s:.1f} s"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(["python bench/sim_speed.py", *(argv or sys.argv[1:])]),
        "trace": args.trace.name,
        "model": args.model,
        "gpu": args.gpu,
        "router": "round robin",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "bar_wall_s": BAR_WALL_S,
        "speed": asdict(speed),
        "coalescing": asdict(coalescing) if coalescing else None,
        "memory": asdict(memory) if memory else None,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    shown = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
    console.print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
