"""The soak: ``gpufleet up`` on a fleet file under steady load for a long time, watched.

    .venv/bin/python bench/soak.py                  # 30 min; bench/results/soak.{json,png}
    .venv/bin/python bench/soak.py --minutes 3      # a short look

``gpufleet up`` runs as a child process (its gateway is that process; the sim engines are
its children). ``--clients`` official ``openai`` clients send chat requests to every
served model of the fleet, streamed and not, in a closed loop with a short pause; every
``--sample`` seconds the bench reads the gateway's RSS and open file descriptors from
``/proc`` and the interval's TTFT (streamed requests: to the first chunk) and failures.

Faults on a schedule (``--chaos-every`` seconds, 0: none), in turn: one engine process
SIGKILLed (the runtime restarts it), and one hung for ``--hang`` seconds (SIGSTOP, then
SIGCONT: a replica that stops answering without closing its connections). Each is logged
with its time and drawn on the plot; the gateway's retries and resumed streams are read from
its ``/metrics`` at the end.

The verdict (issue 14's bar): after ``--warmup`` minutes, RSS grows less than 5 % (the
median of the last three samples against the median of the first three after warm-up),
the open file descriptors do not grow (the median of the last three is at most the most of
the first three: a sample sees the connections open at that instant), and no request
failed. The exit status is 1 when one
of the three does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.up_process: `gpufleet up` as a child process

from tests.up_process import replica_pids, start_up, stop, wait_ready  # noqa: E402

GROWTH_LIMIT = 0.05
FLEET = """
# The soak's fleet: two pools, each with room left when one of its replicas fails (the bar
# is that such a failure costs clients nothing; a pool's only replica cannot promise it).
models:
  - name: llama-3.1-8b
    replicas: 3
    routing: prefix_aware
    args: ["--time-scale", "1"]
  - name: qwen2.5-7b
    replicas: 2
    routing: kv_aware
    args: ["--time-scale", "1"]
"""


@dataclass
class Sample:
    at: float
    """Seconds since the load began."""
    rss_mib: float
    fds: int
    requests: int
    failed: int
    ttft_p50: float | None
    ttft_p99: float | None


@dataclass
class Load:
    """What the clients saw since the last sample."""

    ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _client(
    n: int, api: openai.AsyncOpenAI, models: list[str], load: Load, stop_at: float
) -> None:
    rng = random.Random(n)
    while time.monotonic() < stop_at:
        model = rng.choice(models)
        stream = rng.random() < 0.5
        words = "tell me more " * rng.randint(5, 200)
        messages = [{"role": "user", "content": f"client {n}: {words}"}]
        began = time.monotonic()
        try:
            if stream:
                chunks = await api.chat.completions.create(
                    model=model, messages=messages, max_tokens=rng.randint(16, 128), stream=True
                )
                first = None
                async for _ in chunks:
                    if first is None:
                        first = time.monotonic() - began
                if first is not None:
                    load.ttfts.append(first)
            else:
                await api.chat.completions.create(
                    model=model, messages=messages, max_tokens=rng.randint(16, 128)
                )
            load.requests += 1
        except openai.OpenAIError as error:
            load.requests += 1
            load.failed += 1
            if len(load.errors) < 20:
                load.errors.append(f"{type(error).__name__}: {error}")
        await asyncio.sleep(rng.uniform(0.0, 0.2))


async def _chaos(pid: int, every: float, hang: float, stop_at: float, began: float) -> list:
    """Kill or hang one engine process every ``every`` seconds, in turn (oldest first)."""
    faults: list[dict] = []
    turn = 0
    while time.monotonic() + every < stop_at:
        await asyncio.sleep(every)
        engines = replica_pids(pid)
        if not engines:
            continue
        victim = engines[turn % len(engines)]
        at = round(time.monotonic() - began, 1)
        if turn % 2 == 0:
            os.kill(victim, signal.SIGKILL)
            faults.append({"at": at, "fault": "kill", "pid": victim})
        else:
            os.kill(victim, signal.SIGSTOP)
            faults.append({"at": at, "fault": "hang", "pid": victim, "seconds": hang})
            await asyncio.sleep(hang)
            with contextlib.suppress(ProcessLookupError):  # restarted meanwhile
                os.kill(victim, signal.SIGCONT)
        turn += 1
    return faults


def _counters(base: str, names: tuple[str, ...]) -> dict[str, float]:
    """The gateway's counters whose names start with one of ``names``, by name and their
    ``outcome`` or ``result`` label, summed over the others (read from ``/metrics``)."""
    totals: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(names):
            continue
        series, value = line.rsplit(" ", 1)
        metric, _, labels = series.partition("{")
        kinds = [
            labels.split(f'{key}="')[1].split('"')[0]
            for key in ("outcome", "result")
            if f'{key}="' in labels
        ]
        key = f"{metric}{{{kinds[0]}}}" if kinds else metric
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


async def _drive(args: argparse.Namespace, pid: int, base: str, models: list[str]) -> dict:
    """The load and the samples (the clients add to one ``Load``; a sample takes what came
    since the last one)."""
    load = Load()
    samples: list[Sample] = []
    began = time.monotonic()
    seconds = args.minutes * 60
    stop_at = began + seconds
    api = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    columns = (
        TextColumn("soak"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeRemainingColumn(),
    )
    seen_ttfts = seen_requests = seen_failed = 0
    async with api:
        clients = [_client(n, api, models, load, stop_at) for n in range(args.clients)]
        tasks = [asyncio.create_task(c) for c in clients]
        chaos = None
        if args.chaos_every > 0:
            chaos = asyncio.create_task(_chaos(pid, args.chaos_every, args.hang, stop_at, began))
        with Progress(*columns) as progress:
            bar = progress.add_task("", total=seconds)
            while (left := stop_at - time.monotonic()) > 0:
                await asyncio.sleep(min(args.sample, left))
                ttfts = load.ttfts[seen_ttfts:]
                at = time.monotonic() - began
                sample = Sample(
                    at=round(at, 1),
                    rss_mib=round(_rss_mib(pid), 1),
                    fds=_fds(pid),
                    requests=load.requests - seen_requests,
                    failed=load.failed - seen_failed,
                    ttft_p50=_pct(ttfts, 0.5),
                    ttft_p99=_pct(ttfts, 0.99),
                )
                seen_ttfts, seen_requests, seen_failed = (
                    len(load.ttfts),
                    load.requests,
                    load.failed,
                )
                samples.append(sample)
                progress.update(
                    bar,
                    completed=min(at, seconds),
                    description=f"{sample.rss_mib:.0f} MiB, {sample.fds} fds, "
                    f"{load.requests} requests, {load.failed} failed",
                )
        await asyncio.gather(*tasks)
        faults = [] if chaos is None else await chaos
    return {"samples": samples, "load": load, "faults": faults}


def _verdict(samples: list[Sample], warmup: float, failed: int) -> dict:
    after = [s for s in samples if s.at >= warmup * 60]
    if len(after) < 6:
        raise SystemExit("too few samples after the warm-up: run longer or sample more often")
    start = statistics.median(s.rss_mib for s in after[:3])
    end = statistics.median(s.rss_mib for s in after[-3:])
    growth = (end - start) / start
    # a sample catches whatever connections are open at that instant: compare the usual
    # count at the end with the most seen at the start, not two instants
    fds_start = max(s.fds for s in after[:3])
    fds_end = int(statistics.median(s.fds for s in after[-3:]))
    return {
        "rss_mib_after_warmup": start,
        "rss_mib_at_end": end,
        "rss_growth": round(growth, 4),
        "rss_ok": growth < GROWTH_LIMIT,
        "fds_after_warmup": fds_start,
        "fds_at_end": fds_end,
        "fds_max": max(s.fds for s in after),
        "fds_ok": fds_end <= fds_start,
        "failed": failed,
        "failed_ok": failed == 0,
    }


def _plot(samples: list[Sample], warmup: float, faults: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    minutes = [s.at / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(minutes, [s.rss_mib for s in samples], label="gateway RSS (MiB)")
    top.set_ylabel("RSS (MiB)")
    fds = top.twinx()
    fds.plot(minutes, [s.fds for s in samples], color="tab:orange", label="open fds")
    fds.set_ylabel("open fds")
    top.axvline(warmup, color="grey", linestyle=":", label="end of warm-up")
    top.legend(loc="upper left")
    fds.legend(loc="lower right")
    p99 = [(m, s.ttft_p99) for m, s in zip(minutes, samples, strict=True) if s.ttft_p99]
    bottom.plot([m for m, _ in p99], [v * 1000 for _, v in p99], color="tab:red")
    for fault in faults:
        colour = "black" if fault["fault"] == "kill" else "tab:purple"
        bottom.axvline(fault["at"] / 60, color=colour, linestyle="--", linewidth=0.8)
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT P99 (ms), per sample\n(dashed: kill black, hang purple)")
    bottom.set_xlabel("minutes")
    fig.suptitle("gpufleet up under steady load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=None, help="minutes (10 %% by default)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--fleet", type=Path, default=None, help="default: FLEET (above)")
    parser.add_argument(
        "--chaos-every", type=float, default=120.0, help="seconds between faults (0: none)"
    )
    parser.add_argument("--hang", type=float, default=10.0, help="seconds a hung engine stops")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args(argv)
    warmup = args.minutes / 10 if args.warmup is None else args.warmup
    console = Console()
    with tempfile.TemporaryDirectory(prefix="gpufleet-soak-") as scratch:
        tmp = Path(scratch)
        fleet = args.fleet
        if fleet is None:
            fleet = tmp / "fleet.yaml"
            fleet.write_text(FLEET)
        models = [m["name"] for m in yaml.safe_load(fleet.read_text())["models"]]
        process, base = start_up(fleet, tmp / "up.log", run_dir=tmp / "run", timeout=60)
        try:
            wait_ready(base, timeout=60)
            console.print(f"gpufleet up (pid {process.pid}) at {base}; models {models}")
            result = asyncio.run(_drive(args, process.pid, base, models))
            counters = _counters(
                base,
                (
                    "gpufleet:gateway_retries_total",
                    "gpufleet:gateway_stream_resumes_total",
                    "gpufleet:gateway_ejections_total",
                ),
            )
        finally:
            stop(process)
    samples, load = result["samples"], result["load"]
    verdict = _verdict(samples, warmup, load.failed)
    report = {
        "bench": "soak",
        "command": "bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "fleet": FLEET if args.fleet is None else str(args.fleet),
        "minutes": args.minutes,
        "warmup_minutes": warmup,
        "clients": args.clients,
        "requests": load.requests,
        "failed": load.failed,
        "errors": load.errors,
        "ttft_p99_all": _pct(load.ttfts, 0.99),
        "faults": result["faults"],
        "gateway_counters": counters,
        "verdict": verdict,
        "samples": [asdict(s) for s in samples],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(samples, warmup, result["faults"], args.out.with_suffix(".png"))
    console.print(
        f"{load.requests} requests, {load.failed} failed; RSS {verdict['rss_mib_after_warmup']:.1f}"
        f" -> {verdict['rss_mib_at_end']:.1f} MiB ({100 * verdict['rss_growth']:+.1f} %), fds"
        f" {verdict['fds_after_warmup']} -> {verdict['fds_at_end']}; {len(result['faults'])}"
        f" faults; {counters}; {args.out}"
    )
    ok = verdict["rss_ok"] and verdict["fds_ok"] and verdict["failed_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
