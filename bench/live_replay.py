"""A live recording of ≥ 10,000 requests replays to the same decisions.

    .venv/bin/python bench/live_replay.py [--requests 10300] [--concurrency 32]
    # table + bench/results/live_replay.json

``gpufleet up --record`` (the real command, as a child process) serves a fleet of sim
engine processes on loopback: two pools, prefix-aware and least-request routing, active
health checks, an autoscaled pool, auth off; a closed loop of ``--concurrency`` clients
sends ``--requests`` short chat completions (a shared system prompt, so prefix routing has
something to match), some streamed, some sent by a client that gives up at once. The
gateway is stopped with SIGINT (its recording is flushed on the way out), then ``gpufleet
replay`` (another child process) feeds the recording to a fresh controller: it must say
every decision equals the recorded one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress

RESULTS = Path(__file__).parent / "results"
FLEET = """
gateway: {host: 127.0.0.1, port: 0, scrape_interval: 0.2}
models:
  - name: llama-3.1-8b
    engine: sim
    replicas: 3
    args: ["--time-scale", "20", "--max-num-seqs", "64"]
    routing: prefix_aware
    health: {active: {interval: 0.5}}
  - name: qwen2.5-7b
    engine: sim
    gpu: l40s
    replicas: 2
    args: ["--time-scale", "20", "--max-num-seqs", "64"]
    routing: least_request
    autoscale: {min_replicas: 2, max_replicas: 3, forecast: {enabled: false}}
"""
MODELS = ("llama-3.1-8b", "qwen2.5-7b")
SYSTEM = "You are a helpful assistant. " * 40


async def _load(base: str, requests: int, concurrency: int, progress: Progress) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    task = progress.add_task("requests", total=requests)
    sent = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:

        async def client(n: int) -> None:
            nonlocal sent
            while sent < requests:
                i = sent
                sent += 1
                body = {
                    "model": MODELS[i % 3 == 2],
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"client {n} question {i}"},
                    ],
                    "max_tokens": 8,
                    "stream": i % 4 == 0,
                }
                try:
                    if i % 50 == 7:  # a client that gives up at once
                        async with asyncio.timeout(0.005):
                            await http.post("/v1/chat/completions", json=body)
                        outcomes["200"] += 1
                    else:
                        response = await http.post("/v1/chat/completions", json=body)
                        outcomes[str(response.status_code)] += 1
                except TimeoutError:
                    outcomes["gone"] += 1
                except httpx.HTTPError as error:
                    outcomes[type(error).__name__] += 1
                progress.advance(task)

        await asyncio.gather(*(client(n) for n in range(concurrency)))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_300)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Path(tmp) / "fleet.yaml"
        fleet.write_text(FLEET)
        recording = Path(tmp) / "recording.jsonl"
        up = subprocess.Popen(
            [sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--record",
             str(recording), "--run-dir", tmp],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert up.stdout is not None
        base = None
        for line in up.stdout:
            found = re.search(r"gateway listening on (\S+)", line)
            if found:
                base = found.group(1)
                break
        assert base is not None, "gpufleet up did not start"
        started = time.perf_counter()
        with Progress(console=console) as progress:
            outcomes = asyncio.run(_load(base, args.requests, args.concurrency, progress))
        live_s = time.perf_counter() - started
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
        size = recording.stat().st_size
        lines = recording.read_text().splitlines()[1:]
        kinds = Counter(json.loads(line)["event"]["kind"] for line in lines)
        started = time.perf_counter()
        replayed = subprocess.run(
            [sys.executable, "-m", "gpufleet", "replay", str(recording)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        replay_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "outcomes": dict(outcomes),
        "events": dict(kinds),
        "recording_mb": round(size / 1e6, 2),
        "live_s": round(live_s, 1),
        "replay_s": round(replay_s, 1),
        "replay_exit": replayed.returncode,
        "identical": replayed.returncode == 0
        and "every decision equals the recorded one" in replayed.stderr,
        "replay_says": replayed.stderr.strip().splitlines()[-2:],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "live_replay.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))
    if not result["identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
