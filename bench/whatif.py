"""What-if on a live recording: its traffic under round-robin and prefix-aware routing.

    .venv/bin/python bench/whatif.py [--sessions 64] [--turns 8] [--concurrency 12]
    # table + bench/results/whatif.{json,png}

1. **Record.** ``gpufleet up --record`` (the real command, a child process) serves three sim
   engine processes of Llama-3.1-8B on loopback (time scale 1: modelled time is real time)
   with prefix-aware routing, so the gateway hashes every prompt, and auth on, so it meters
   every answer and the recording has its output tokens (three tenants' keys in a SQLite
   store). ``--concurrency`` closed-loop clients hold ``--sessions`` chat sessions of
   ``--turns`` turns over four system prompts (2.7–4.2 kB each): each turn sends the system
   prompt, the conversation so far (its questions and the answers it got) and a new
   question, with ``x-session-id``, then thinks 0.2–1 s. One request in 40 is sent by a client
   that gives up after 5 ms (the recording has no output length for it). SIGINT stops the
   gateway, which flushes the recording.
2. **What-if.** ``FleetSimulation`` (what ``gpufleet simulate --trace recording.jsonl``
   runs) replays the recording's arrivals on three modelled replicas of the same model and
   GPU, once per routing policy, ``round_robin`` and ``prefix_aware``, same seed. Reported
   per policy: the prefix-cache hit rate (cached ÷ prompt tokens) and TTFT P50 / P99, and the
   difference prefix-aware − round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from rich.table import Table

from gpufleet.config import parse_fleet
from gpufleet.sim import FleetSimulation, SimOptions, load_trace
from gpufleet.store import Store, TenantSettings

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "whatif.json"
PLOT = ROOT / "bench" / "results" / "whatif.png"
MODEL = "llama-3.1-8b"
REPLICAS = 3
MAX_NUM_SEQS = 32
POLICIES = ("round_robin", "prefix_aware")
TENANTS = ("search", "support", "batch")
LIVE_FLEET = """
gateway: {{host: 127.0.0.1, port: 0, scrape_interval: 0.2}}
tenants: {{auth: true, database_url: "sqlite:///{db}"}}
models:
  - name: {model}
    engine: sim
    replicas: {replicas}
    args: ["--time-scale", "1", "--max-num-seqs", "{seqs}"]
    routing: prefix_aware
"""
TOPICS = ("a travel agency", "a tax office", "a bicycle shop", "a cloud provider")


def system_prompts(rng: random.Random) -> list[str]:
    """Four distinct system prompts of 2.7–4.2 kB (5–8 of the gateway's 512-character blocks)."""
    prompts = []
    for topic in TOPICS:
        count = rng.randrange(60, 120)
        rules = [f"Rule {k}: about item {rng.randrange(10_000)}, be brief." for k in range(count)]
        prompts.append(f"You are the assistant of {topic}. " + " ".join(rules))
    return prompts


async def _sessions(
    base: str, keys: list[str], args: argparse.Namespace, progress: Progress
) -> Counter[str]:
    rng = random.Random(args.seed)
    systems = system_prompts(rng)
    outcomes: Counter[str] = Counter()
    task = progress.add_task("live requests", total=args.sessions * args.turns)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(args.sessions):
        queue.put_nowait(n)
    sent = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:

        async def session(n: int) -> None:
            nonlocal sent
            mine = random.Random(f"{args.seed}-{n}")
            messages = [{"role": "system", "content": systems[n % len(systems)]}]
            headers = {
                "authorization": f"Bearer {keys[n % len(keys)]}",
                "x-session-id": f"session-{n}",
            }
            for turn in range(args.turns):
                question = f"Turn {turn}: what about item {mine.randrange(10_000)}? " * 3
                messages.append({"role": "user", "content": question})
                body = {"model": MODEL, "messages": messages, "max_tokens": mine.randint(16, 96)}
                sent += 1
                answer = ""
                try:
                    if sent % 40 == 0:  # a client that gives up at once
                        async with asyncio.timeout(0.005):
                            await http.post("/v1/chat/completions", json=body, headers=headers)
                        outcomes["200"] += 1
                    else:
                        response = await http.post(
                            "/v1/chat/completions", json=body, headers=headers
                        )
                        outcomes[str(response.status_code)] += 1
                        if response.status_code == 200:
                            answer = response.json()["choices"][0]["message"]["content"]
                except TimeoutError:
                    outcomes["gone"] += 1
                messages.append({"role": "assistant", "content": answer})
                progress.advance(task)
                await asyncio.sleep(mine.uniform(0.2, 1.0))

        async def client() -> None:
            while not queue.empty():
                await session(queue.get_nowait())

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return outcomes


def record(args: argparse.Namespace, tmp: Path, console: Console) -> dict[str, Any]:
    """Serve the live fleet under ``gpufleet up --record``; the recording and what was sent."""
    db = tmp / "gpufleet.db"
    store = Store.open(f"sqlite:///{db}")
    try:
        keys = [store.create_key(t, TenantSettings())[1] for t in TENANTS]
    finally:
        store.close()
    fleet = tmp / "live.yaml"
    fleet.write_text(LIVE_FLEET.format(db=db, model=MODEL, replicas=REPLICAS, seqs=MAX_NUM_SEQS))
    recording = tmp / "recording.jsonl"
    up = subprocess.Popen(
        [sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--record",
         str(recording), "--run-dir", str(tmp / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    base = None
    for line in up.stdout:
        found = re.search(r"gateway listening on (\S+)", line)
        if found:
            base = found.group(1)
            break
    if base is None:
        up.kill()
        raise SystemExit("gpufleet up did not start")
    started = time.perf_counter()
    try:
        with Progress(console=console) as progress:
            outcomes = asyncio.run(_sessions(base, keys, args, progress))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    return {
        "path": recording,
        "live_s": round(time.perf_counter() - started, 1),
        "outcomes": dict(outcomes),
        "recording_mb": round(recording.stat().st_size / 1e6, 2),
    }


def what_if(recording: Path, policy: str, seed: int) -> tuple[dict[str, Any], list[float]]:
    """The recording replayed on modelled replicas routed by ``policy``: summary, TTFTs."""
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": MODEL,
                    "replicas": REPLICAS,
                    "args": ["--max-num-seqs", str(MAX_NUM_SEQS)],
                    "routing": policy,
                }
            ]
        }
    )
    sim = FleetSimulation(fleet, SimOptions(seed=seed))
    reader = load_trace(recording)
    sim.start(reader)
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    problems = sim.check()
    if problems:
        raise RuntimeError(f"{policy}: {problems}")
    report = sim.report({"policy": policy})
    o = report["overall"]
    summary = {
        "requests": o["requests"],
        "rejected": o["rejected"],
        "prefix_hit_rate": o["prefix_hit_rate"],
        "ttft_p50_s": o["ttft_s"]["p50"],
        "ttft_p99_s": o["ttft_s"]["p99"],
        "e2e_p50_s": o["e2e_s"]["p50"],
        "matched_prefix_blocks": report["routing"]["matched_prefix_blocks"],
        "simulated_s": report["simulated_s"],
        "wall_s": round(wall, 2),
        "estimated_outputs": reader.estimated,
    }
    return summary, sim.latencies()[MODEL]["ttft"]


def trace_facts(recording: Path) -> dict[str, Any]:
    """What the recording holds as a trace: requests, sessions, tenants, shared blocks."""
    reader = load_trace(recording)
    requests = list(reader)
    blocks = Counter(h for r in requests for h in r.hash_ids or ())
    return {
        "requests": len(requests),
        "span_s": round(requests[-1].arrival_s, 1) if requests else 0.0,
        "sessions": len({r.session for r in requests}),
        "tenants": sorted({r.tenant or "" for r in requests}),
        "input_tokens_mean": round(sum(r.input_tokens for r in requests) / len(requests), 1),
        "output_tokens_mean": round(sum(r.output_tokens for r in requests) / len(requests), 1),
        "estimated_outputs": reader.estimated,
        "prefix_blocks": {
            "distinct": len(blocks),
            "referenced": sum(blocks.values()),
            "shared": sum(1 for n in blocks.values() if n > 1),
        },
        "notes": [n.replace(str(recording), "recording.jsonl") for n in reader.notes],
    }


def plot(ttfts: dict[str, list[float]], runs: dict[str, dict[str, Any]]) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 4.2), layout="constrained", width_ratios=(2, 1)
    )
    for policy, values in ttfts.items():
        n = len(values)
        left.plot([v * 1000 for v in values], [(i + 1) / n for i in range(n)], label=policy)
    left.set_xscale("log")
    left.set_xlabel("TTFT (ms, log)")
    left.set_ylabel("share of requests")
    left.set_title("TTFT on the recorded traffic")
    left.legend(loc="lower right")
    names = list(runs)
    bars = right.bar(names, [runs[p]["prefix_hit_rate"] * 100 for p in names], color=["C0", "C1"])
    right.bar_label(bars, fmt="%.1f %%")
    right.set_ylabel("prefix-cache hit rate (%)")
    right.set_title("cached ÷ prompt tokens")
    fig.savefig(PLOT, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as scratch:
        live = record(args, Path(scratch), console)
        recording = live.pop("path")
        facts = trace_facts(recording)
        runs: dict[str, dict[str, Any]] = {}
        ttfts: dict[str, list[float]] = {}
        with Progress(console=console) as progress:
            task = progress.add_task("what-if runs", total=len(POLICIES))
            for policy in POLICIES:
                runs[policy], ttfts[policy] = what_if(recording, policy, args.seed)
                progress.advance(task)
    rr, prefix = runs["round_robin"], runs["prefix_aware"]
    difference = {
        "prefix_hit_rate": round(prefix["prefix_hit_rate"] - rr["prefix_hit_rate"], 4),
        "ttft_p50_s": round(prefix["ttft_p50_s"] - rr["ttft_p50_s"], 6),
        "ttft_p99_s": round(prefix["ttft_p99_s"] - rr["ttft_p99_s"], 6),
    }
    result = {
        "command": "python bench/whatif.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "live": {"fleet": f"{REPLICAS} × {MODEL} sim engines, prefix_aware, auth on", **live},
        "recording_as_trace": facts,
        "what_if": runs,
        "prefix_aware_minus_round_robin": difference,
    }
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    plot(ttfts, runs)
    table = Table(title=f"What-if on a live recording of {facts['requests']:,} requests")
    table.add_column("")
    for name in (*POLICIES, "difference"):
        table.add_column(name, justify="right")
    table.add_row(
        "prefix hit rate",
        *(f"{runs[p]['prefix_hit_rate']:.1%}" for p in POLICIES),
        f"{difference['prefix_hit_rate'] * 100:+.1f} pt",
    )
    for key, label in (("ttft_p50_s", "TTFT P50 (ms)"), ("ttft_p99_s", "TTFT P99 (ms)")):
        table.add_row(
            label,
            *(f"{runs[p][key] * 1000:.1f}" for p in POLICIES),
            f"{difference[key] * 1000:+.1f}",
        )
    console.print(table)
    for note in facts["notes"]:
        console.print(f"note: {note}", markup=False)
    console.print(f"wrote {RESULT.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
