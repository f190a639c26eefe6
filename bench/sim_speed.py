"""How fast the fleet simulator replays a real trace: the issue's speed bar, measured.

    .venv/bin/python bench/sim_speed.py    # table + bench/results/sim_speed.json

The full Azure LLM 2023 conversation trace (19,366 requests over one hour) on 8 replicas of
Llama-3.1-8B on H100-SXM, routed round robin, on one core. The bar: under 60 s of wall time.
Three parts, in this order (peak RSS is a process-wide maximum, so the speed run comes first):

* ``speed``: the replicas fast-forward their runs of pure-decode steps (the default): wall
  time, simulated seconds per wall second, kernel events and replica steps per second (fast
  ones included, and how many were fast), peak RSS, the run's latencies and digest;
* ``baseline``: the same run again, one kernel event per step (``fast_forward=False``), in
  the same process; the ratio of the wall times, and whether the digests are equal (they
  must be: the fast-forward changes no result);
* ``memory``: a synthetic million-request trace: bytes per ``TraceRequest`` held in a list,
  and the peak while streaming it (tracemalloc).

``--no-fast-forward`` measures only the event-by-event run, ``--no-baseline`` only the fast
one. The trace is read from ``../shared/traces`` (beside the clone) or ``--trace``.
"""

from __future__ import annotations

import argparse
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

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import ReplicaConfig, ReplicaModel
from gpufleet.sim import FleetHarness, LogHistogram, PromptBuilder, TraceRequest, load_trace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
DEFAULT_OUT = REPO / "bench" / "results" / "sim_speed.json"
BAR_WALL_S = 60.0
SLICE_S = 20.0
"""Simulated seconds between progress-bar updates."""


@dataclass
class Speed:
    fast_forward: bool
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
    fast_steps: int
    """Steps applied by a fast-forward (no kernel event, plan or outputs)."""
    fast_runs: int
    """Fast-forwards: runs of pure-decode steps applied at once."""
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


def run_speed(args: argparse.Namespace, console: Console, *, fast_forward: bool) -> Speed:
    last = 0.0
    for request in load_trace(args.trace, duration=args.duration):
        last = request.arrival_s
    model = get_model(args.model)
    harness = FleetHarness(
        _replicas(args), PromptBuilder(model.vocab_size), fast_forward=fast_forward
    )
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
    name = "fast-forward" if fast_forward else "event by event"
    start = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(name, total=last, requests=0)
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
    drivers = harness.drivers
    steps = sum(d.steps for d in drivers)
    return Speed(
        fast_forward=fast_forward,
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
        fast_steps=sum(d.fast_steps for d in drivers),
        fast_runs=sum(d.fast_runs for d in drivers),
        peak_rss_mib=rss_mib,
        mean_busy=sum(d.busy_s for d in drivers) / len(drivers) / kernel.now,
        ttft_p50_s=_quantile(ttft, 0.5),
        ttft_p99_s=_quantile(ttft, 0.99),
        e2e_p50_s=_quantile(e2e, 0.5),
        e2e_p99_s=_quantile(e2e, 0.99),
        itl_mean_s=itl.mean or 0.0,
        itl_p50_s=itl.quantile(0.5) or 0.0,
        itl_p99_s=itl.quantile(0.99) or 0.0,
        digest=harness.recorder.digest(),
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
    harness = FleetHarness(
        _replicas(args), PromptBuilder(model.vocab_size), fast_forward=not args.no_fast_forward
    )
    harness.start(load_trace(args.trace, duration=args.profile))
    profiler = cProfile.Profile()
    profiler.runcall(harness.run)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    console.print(f"[bold]cProfile, first {args.profile:.0f} simulated seconds, by own time")
    stats.sort_stats("tottime").print_stats(15)


def _speed_rows(speed: Speed) -> list[tuple[str, str]]:
    rows = [
        ("wall time", f"{speed.wall_s:,.1f} s  (bar < {BAR_WALL_S:.0f} s)"),
        ("sim s / wall s", f"{speed.sim_s_per_wall_s:,.1f}"),
        ("events / s", f"{speed.events_per_s:,.0f}  ({speed.events:,})"),
        ("steps / s", f"{speed.steps_per_s:,.0f}  ({speed.steps:,}, {speed.us_per_step:.1f} µs)"),
    ]
    if speed.fast_forward:
        mean_run = speed.fast_steps / speed.fast_runs if speed.fast_runs else 0.0
        rows.append(
            (
                "fast-forwarded steps",
                f"{speed.fast_steps / speed.steps:.0%} in {speed.fast_runs:,} runs "
                f"of {mean_run:.1f}",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--duration", type=float, default=None, help="simulate a prefix (s)")
    parser.add_argument(
        "--no-fast-forward", action="store_true", help="only the event-by-event run"
    )
    parser.add_argument("--no-baseline", action="store_true", help="only the fast-forward run")
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
    if args.no_fast_forward and args.no_baseline:
        console.print("[red]--no-fast-forward and --no-baseline leave nothing to measure")
        return 2
    if args.profile:
        profile(args, console)
        return 0

    speed = None if args.no_fast_forward else run_speed(args, console, fast_forward=True)
    baseline = None if args.no_baseline else run_speed(args, console, fast_forward=False)
    memory = run_memory(args.memory_requests) if args.memory_requests else None
    headline = speed or baseline
    assert headline is not None

    table = Table(title=f"fleet simulator: {args.trace.name}, {args.replicas} × {args.model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{headline.requests:,}"),
        ("simulated", f"{headline.sim_s:,.0f} s"),
    ]
    for run in (speed, baseline):
        if run is not None:
            label = "fast-forward" if run.fast_forward else "event by event"
            rows += [(f"{label}: {name}", value) for name, value in _speed_rows(run)]
    ratio = digests_equal = None
    if speed is not None and baseline is not None:
        ratio = baseline.wall_s / speed.wall_s
        digests_equal = speed.digest == baseline.digest
        rows += [
            ("speed-up (same process)", f"{ratio:.2f}×"),
            ("digests equal", "yes" if digests_equal else "[red]NO"),
        ]
    rows += [
        ("peak RSS", f"{headline.peak_rss_mib:,.0f} MiB"),
        ("replica busy", f"{headline.mean_busy:.0%}"),
        ("TTFT p50 / p99", f"{headline.ttft_p50_s * 1e3:.1f} / {headline.ttft_p99_s * 1e3:.1f} ms"),
        ("E2E p50 / p99", f"{headline.e2e_p50_s:.2f} / {headline.e2e_p99_s:.2f} s"),
        ("ITL p50 / p99", f"{headline.itl_p50_s * 1e3:.2f} / {headline.itl_p99_s * 1e3:.2f} ms"),
        ("digest", headline.digest[:16]),
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
        "speed": asdict(speed) if speed else None,
        "baseline": asdict(baseline) if baseline else None,
        "speedup": ratio,
        "digests_equal": digests_equal,
        "memory": asdict(memory) if memory else None,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    shown = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
    console.print(f"wrote {shown}")
    return 0 if digests_equal is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
