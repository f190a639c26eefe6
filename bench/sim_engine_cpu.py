"""CPU cost of the sim engine: can one replica stream its modelled token rate on one core?

    .venv/bin/python bench/sim_engine_cpu.py      # table + bench/results/sim_engine_cpu.json

One ``gpufleet engine sim`` process (llama-3.1-8b on h100-sxm, real time) serves a closed loop
of ``--concurrency`` streaming completions (``ignore_eos``, fixed lengths) from a load
generator in *this* process — a separate process, pinned to another core when there is one,
so the server's CPU time (``/proc/<pid>/stat``) is its own.

Two rates are compared over the same measurement window:

* achieved: SSE token events the clients received per real second;
* modelled: what the replica model itself produces for the same closed loop in virtual time
  (the same prompts through a fresh ``ReplicaModel``; each finished client resubmits at once).

The server keeps up when achieved ≈ modelled and its loop reports (almost) no lag
(``gpufleet:sim_engine_lag_seconds_total``). The headline is CPU seconds per streamed token
and the share of one core the server used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop
from rich.console import Console
from rich.table import Table

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine import Tokenizer
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sim_engine_cpu.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")
VOCAB_WORDS = [
    "the",
    "river",
    "stone",
    "bridge",
    "mill",
    "market",
    "tower",
    "garden",
    "field",
    "morning",
]


@dataclass
class Result:
    model: str
    gpu: str
    concurrency: int
    prompt_words: int
    output_tokens: int
    window_s: float
    tokens_streamed: int
    achieved_tokens_per_s: float
    modelled_tokens_per_s: float
    achieved_over_modelled: float
    server_cpu_s: float
    server_cores_used: float
    cpu_us_per_token: float
    loop_lag_s: float
    client_cores_used: float
    mean_itl_ms_client: float
    priority: str
    command: str


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"client {i}: " + " ".join(rng.choice(VOCAB_WORDS) for _ in range(words))
        for i in range(count)
    ]


def realtime(*pids: int) -> str:
    """Round-robin real-time priority for server and client (root only), so that other work
    on a shared machine does not masquerade as sim engine lag."""
    try:
        for pid in (os.getpid(), *pids):
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setscheduler(int(task.name), os.SCHED_RR, os.sched_param(10))
    except OSError:
        return "normal"
    return "SCHED_RR 10"


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [
        sys.executable, "-m", "gpufleet", "engine", "sim", "--model", args.model, "--gpu",
        args.gpu, "--port", "0", "--max-num-seqs", str(max(256, args.concurrency)),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if "listening on " not in line:
        process.kill()
        raise SystemExit(f"sim engine did not start: {line!r}")
    url = line.split("listening on ")[1].split(",")[0]
    return process, url


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


class Counters:
    def __init__(self) -> None:
        self.tokens = 0
        self.gaps: list[float] = []


async def one_stream(host: str, port: int, body: bytes, counters: Counters) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    tail = b""
    last = None
    while True:
        data = await reader.read(65536)
        if not data:
            break
        seen = tail + data
        events = seen.count(b"data: {")
        if events:
            now = time.perf_counter()
            if last is not None:
                counters.gaps.append((now - last) / events)
            last = now
            counters.tokens += events
        tail = seen[-8:]
        if b"data: [DONE]" in seen:
            break
    writer.close()


async def load(url: str, args: argparse.Namespace, texts: list[str]) -> tuple[Counters, float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    counters = Counters()
    stop = asyncio.Event()

    async def client(i: int) -> None:
        body = json.dumps(
            {
                "model": args.model,
                "prompt": texts[i],
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        await asyncio.sleep(i * args.stagger)
        while not stop.is_set():
            await one_stream(host, int(port), body, counters)

    async with asyncio.TaskGroup() as group:
        for i in range(args.concurrency):
            group.create_task(client(i))
        await asyncio.sleep(args.warmup)
        start_tokens, start = counters.tokens, time.perf_counter()
        counters.gaps.clear()
        args.cpu_start = cpu_seconds(args.pid)
        args.lag_start = await lag(url)
        await asyncio.sleep(args.window)
        window = time.perf_counter() - start
        args.cpu_end = cpu_seconds(args.pid)
        args.lag_end = await lag(url)
        measured = Counters()
        measured.tokens = counters.tokens - start_tokens
        measured.gaps = list(counters.gaps)
        stop.set()
    return measured, window


async def lag(url: str) -> float:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n")
    text = (await reader.read(-1)).decode()
    writer.close()
    for line in text.splitlines():
        if line.startswith("gpufleet:sim_engine_lag_seconds_total"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def modelled_rate(args: argparse.Namespace, texts: list[str], horizon: float) -> float:
    """Tokens per modelled second of the same closed loop, in virtual time."""
    model = ReplicaModel(
        ReplicaConfig(
            get_model(args.model), get_gpu(args.gpu), max_num_seqs=max(256, args.concurrency)
        )
    )
    tokenizer = Tokenizer(get_model(args.model).vocab_size)
    ids = [tokenizer.encode(text) for text in texts]
    serial = 0

    def submit(i: int, now: float) -> None:
        nonlocal serial
        serial += 1
        request = NewRequest(f"{i}-{serial}", ids[i], args.output_tokens, ignore_eos=True)
        model.add_request(request, now)

    owner: dict[str, int] = {}
    starts = [i * args.stagger for i in range(len(texts))]  # as the clients start
    next_client = 0
    now, tokens, start_tokens, start = 0.0, 0, 0, None
    warm = args.warmup
    while now < warm + horizon:
        while next_client < len(texts) and starts[next_client] <= now:
            submit(next_client, starts[next_client])
            owner[f"{next_client}-{serial}"] = next_client
            next_client += 1
        plan = model.plan_step(now)
        if plan is None:
            now = starts[next_client]
            continue
        now += plan.duration
        for output in model.finish_step(plan, now):
            tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                i = owner.pop(output.request_id)
                submit(i, now)
                owner[f"{i}-{serial}"] = i
        if start is None and now >= warm:
            start, start_tokens = now, tokens
    assert start is not None
    return (tokens - start_tokens) / (now - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stagger", type=float, default=0.02, help="Client i starts i x this many seconds late."
    )
    parser.add_argument("--no-pin", action="store_true", help="Do not pin server and client.")
    parser.add_argument(
        "--no-realtime", action="store_true", help="Do not raise server and client priority."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    texts = prompts(args.concurrency, args.prompt_words, args.seed)
    process, url = start_server(args)
    args.pid = process.pid
    cores = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cores) >= 2:
        os.sched_setaffinity(process.pid, {cores[0]})
        for task in Path(f"/proc/{process.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), {cores[0]})
        os.sched_setaffinity(0, {cores[1]})
    priority = "normal" if args.no_realtime else realtime(process.pid)
    try:
        client_cpu0 = time.process_time()
        measured, window = uvloop.run(load(url, args, texts))
        client_cpu = time.process_time() - client_cpu0
    finally:
        process.terminate()
        process.wait(timeout=10)
    modelled = modelled_rate(args, texts, args.window)
    server_cpu = args.cpu_end - args.cpu_start
    achieved = measured.tokens / window
    result = Result(
        model=args.model,
        gpu=args.gpu,
        concurrency=args.concurrency,
        prompt_words=args.prompt_words,
        output_tokens=args.output_tokens,
        window_s=round(window, 3),
        tokens_streamed=measured.tokens,
        achieved_tokens_per_s=round(achieved, 1),
        modelled_tokens_per_s=round(modelled, 1),
        achieved_over_modelled=round(achieved / modelled, 4),
        server_cpu_s=round(server_cpu, 3),
        server_cores_used=round(server_cpu / window, 3),
        cpu_us_per_token=round(1e6 * server_cpu / max(1, measured.tokens), 2),
        loop_lag_s=round(args.lag_end - args.lag_start, 4),
        client_cores_used=round(client_cpu / (window + args.warmup), 3),
        mean_itl_ms_client=round(1e3 * statistics.fmean(measured.gaps), 3)
        if measured.gaps
        else float("nan"),
        priority=priority,
        command=" ".join([Path(sys.executable).name, *sys.argv]),
    )
    table = Table(title=f"sim engine CPU: {args.model} on {args.gpu}, {args.concurrency} streams")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in asdict(result).items():
        if key != "command":
            table.add_row(key, str(value))
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
