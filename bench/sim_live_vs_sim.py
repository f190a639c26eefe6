"""Live and simulated agree: one request stream through `gpufleet up` and `gpufleet simulate`.

    .venv/bin/python bench/sim_live_vs_sim.py   # table + bench/results/sim_live_vs_sim.json

A slice of the Azure 2023 conversation trace (``--duration`` seconds after ``--rate-scale``)
is replayed twice on the same fleet file (``--replicas`` sim replicas of Llama-3.1-8B on
H100-SXM, round robin, real time):

* **live**: ``gpufleet up`` in a subprocess on a free port; this process sends every request
  at its trace arrival time as a streaming ``/v1/completions`` call with the trace's prompt
  length (token ids), ``max_tokens`` = the trace's output length and ``ignore_eos``, and
  measures TTFT (first token event) and end-to-end latency (``[DONE]``) client-side;
* **simulated**: ``FleetSimulation`` (what ``gpufleet simulate`` runs) on the same fleet file
  and slice, in virtual time.

The bar (issue 5): TTFT and end-to-end P50 and P99 within 10 % of each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from gpufleet.config import load_fleet
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
RESULT = ROOT / "bench" / "results" / "sim_live_vs_sim.json"
QUANTILES = (0.5, 0.99)


@dataclass
class Sent:
    request: TraceRequest
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


def fleet_file(where: Path, replicas: int, port: int) -> Path:
    path = where / "fleet.yaml"
    path.write_text(
        f"gateway:\n  host: 127.0.0.1\n  port: {port}\n"
        "models:\n  - name: llama-3.1-8b\n    engine: sim\n    gpu: h100-sxm\n"
        f"    replicas: {replicas}\n    routing: round_robin\n"
        '    args: ["--time-scale", "1"]\n'
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def send(host: str, port: int, job: Sent, ids: list[int]) -> None:
    body = json.dumps(
        {
            "model": "llama-3.1-8b",
            "prompt": ids,
            "max_tokens": job.request.output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    job.sent = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        seen = tail + data
        events = seen.count(b"data: {")
        if events and job.first is None:
            job.first = now
        job.tokens += events
        tail = seen[-16:]
        if b"data: [DONE]" in seen:
            job.done = now
            break
    writer.close()
    if job.done is None:
        job.errors.append("stream ended without [DONE]")


async def replay_live(port: int, stream: list[TraceRequest], seed: int) -> list[Sent]:
    rng = random.Random(seed)
    jobs = [Sent(r) for r in stream]
    prompts = [[rng.randrange(1000, 100_000) for _ in range(r.input_tokens)] for r in stream]
    start = time.perf_counter() + 0.5

    async def one(job: Sent, ids: list[int]) -> None:
        await asyncio.sleep(max(0.0, start + job.request.arrival_s - time.perf_counter()))
        try:
            await send("127.0.0.1", port, job, ids)
        except OSError as error:
            job.errors.append(str(error))

    async with asyncio.TaskGroup() as group:
        for job, ids in zip(jobs, prompts, strict=True):
            group.create_task(one(job, ids))
    return jobs


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {f"p{round(q * 100)}": ordered[int(q * (n - 1))] for q in QUANTILES}


def start_gateway(fleet: Path, run_dir: Path, port: int) -> subprocess.Popen[bytes]:
    log = (run_dir / "up.log").open("wb")
    exe = Path(sys.executable).parent / "gpufleet"
    proc = subprocess.Popen(
        [str(exe), "up", "--fleet", str(fleet), "--run-dir", str(run_dir / "run")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpufleet up exited: {(run_dir / 'up.log').read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("gateway not ready after 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=AZURE)
    parser.add_argument("--rate-scale", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    stream = list(load_trace(args.trace, rate_scale=args.rate_scale, duration=args.duration))
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        port = free_port()
        fleet = fleet_file(where, args.replicas, port)
        proc = start_gateway(fleet, where, port)
        try:
            wall = time.perf_counter()
            jobs = asyncio.run(replay_live(port, stream, args.seed))
            wall = time.perf_counter() - wall
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        config = load_fleet(fleet)
    failed = [j for j in jobs if j.errors or j.first is None or j.done is None]
    ok = [j for j in jobs if j not in failed]
    live = {
        "ttft_s": quantiles([j.first - j.sent for j in ok if j.first is not None]),
        "e2e_s": quantiles([j.done - j.sent for j in ok if j.done is not None]),
    }
    lateness = [
        j.sent - (jobs[0].sent - jobs[0].request.arrival_s) - j.request.arrival_s for j in ok
    ]

    sim = FleetSimulation(config, SimOptions(seed=args.seed))
    sim.start(stream)
    sim.run()
    assert sim.check() == []
    simulated = {}
    records = [r for r in sim.harness.recorder.log if not r.failed and not r.rejected]
    simulated["ttft_s"] = quantiles([r.ttft_s for r in records if r.ttft_s is not None])
    simulated["e2e_s"] = quantiles([r.e2e_s for r in records])

    table = Table(
        title=f"live vs simulated: {len(stream)} requests, {args.duration:g} s of the Azure "
        f"conversation trace at rate ×{args.rate_scale:g}, {args.replicas} replicas, round robin"
    )
    for column in ("metric", "live (ms)", "simulated (ms)", "sim / live"):
        table.add_column(column, justify="right")
    rows = {}
    for metric in ("ttft_s", "e2e_s"):
        for q in ("p50", "p99"):
            a, b = live[metric][q], simulated[metric][q]
            rows[f"{metric}_{q}"] = {"live": a, "simulated": b, "ratio": b / a}
            table.add_row(
                f"{metric[:-2].upper()} {q}", f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a:.3f}"
            )
    Console().print(table)
    within = all(abs(r["ratio"] - 1) <= 0.10 for r in rows.values())
    print(
        f"within 10 %: {within}; {len(failed)} live failures; wall {wall:.1f} s; "
        f"send lateness p99 {quantiles(lateness)['p99'] * 1e3:.1f} ms"
    )
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/sim_live_vs_sim.py " + " ".join(sys.argv[1:]),
                "trace": str(args.trace.name),
                "rate_scale": args.rate_scale,
                "duration_s": args.duration,
                "replicas": args.replicas,
                "requests": len(stream),
                "live_failures": len(failed),
                "live_wall_s": round(wall, 1),
                "send_lateness_p99_s": round(quantiles(lateness)["p99"], 4),
                "metrics": {k: {kk: round(vv, 5) for kk, vv in v.items()} for k, v in rows.items()},
                "within_10_percent": within,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
