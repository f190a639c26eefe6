"""Routing quality through the real gateway: the Mooncake conversation trace on 4 sim replicas.

    .venv/bin/python bench/gateway_routing_quality.py
    # table + bench/results/gateway_routing_quality.json; ~6 min on the 2-core VM

The first ``--requests`` requests of the Mooncake FAST'25 conversation trace (``hash_ids``:
512-token prefix blocks) are replayed, with their arrival times divided by ``--compress``, through
``gpufleet up`` (a subprocess; a temporary fleet file: ``--replicas`` sim replicas of llama-3.1-8b
on h100-sxm, engine args ``--time-scale <compress>`` so that the *modelled* replicas see the trace's
own arrival rate while the run takes 1/compress of the wall time). One fleet per policy, started
and stopped in turn, each fed the same request stream: ``prefix_aware``, ``kv_aware``,
``round_robin``.

Prompts: each hash id maps to a fixed block of 512 words (seeded by the id, drawn from a 4,096-word
list; every word is one token of the sim engine's tokenizer), a request's text is its blocks' words
joined and cut to ``min(input_length, --max-input)`` words, so requests that share hash-id prefixes
share text prefixes and token prefixes. Each is a streaming ``/v1/completions`` call with
``max_tokens = min(output_length, --max-output)`` and ``ignore_eos``; TTFT is taken client-side (the
first token event). At the end every replica's ``/metrics`` gives ``vllm:prefix_cache_hits_total``,
``vllm:prefix_cache_queries_total``, ``vllm:prompt_tokens_total`` and ``num_gpu_blocks``.

The reference: one LRU cache of 16-token blocks as large as the replicas' KV caches together, fed
the same token stream in arrival order (a request hits its leading cached blocks, at most
``(tokens − 1) // 16`` of them, as the engine does; then its full blocks become most recent, root
last). The bar (issue 4): ``prefix_aware`` keeps ≥ 80 % of that hit rate while no replica gets more
than 1.5 × the mean prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gpufleet.engine import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "gateway_routing_quality.json"
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
MODEL = "llama-3.1-8b"
POLICIES = ("prefix_aware", "kv_aware", "round_robin")
HASH_BLOCK = 512  # tokens (words here) per Mooncake hash id
KV_BLOCK = 16  # the sim engine's KV block, tokens
VOCAB = [f"w{i}" for i in range(4096)]


@dataclass
class Job:
    at: float
    hash_ids: tuple[int, ...]
    words: int
    max_tokens: int
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    error: str | None = None


@dataclass
class PolicyResult:
    policy: str
    requests: int
    failures: int
    hits: int = 0
    queries: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    ttft_ms: dict[str, float] = field(default_factory=dict)
    send_lateness_p99_ms: float = 0.0
    wall_s: float = 0.0
    num_gpu_blocks: list[int] = field(default_factory=list)
    engine_lag_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


# -- prompts ---------------------------------------------------------------------------------

_blocks: dict[int, list[str]] = {}


def block_words(hash_id: int) -> list[str]:
    words = _blocks.get(hash_id)
    if words is None:
        rng = random.Random(hash_id * 7919 + 17)
        words = _blocks[hash_id] = [VOCAB[rng.randrange(len(VOCAB))] for _ in range(HASH_BLOCK)]
    return words


def prompt_words(job: Job) -> list[str]:
    out: list[str] = []
    for h in job.hash_ids:
        out += block_words(h)
        if len(out) >= job.words:
            break
    if len(out) < job.words:  # a trace row with fewer hash ids than its length needs
        out += block_words(-1 - len(job.hash_ids))[: job.words - len(out)]
    return out[: job.words]


def load_slice(trace: Path, n: int, compress: float, max_input: int, max_output: int) -> list[Job]:
    jobs: list[Job] = []
    with trace.open() as f:
        for line in f:
            if len(jobs) >= n:
                break
            row = json.loads(line)
            words = min(int(row["input_length"]), max_input)
            jobs.append(
                Job(
                    at=row["timestamp"] / 1000.0 / compress,
                    hash_ids=tuple(row["hash_ids"][: -(-words // HASH_BLOCK)]),
                    words=words,
                    max_tokens=max(1, min(int(row["output_length"]), max_output)),
                )
            )
    t0 = jobs[0].at
    for job in jobs:
        job.at -= t0
    return jobs


# -- the pooled-LRU reference ------------------------------------------------------------------


def pooled_lru(jobs: list[Job], capacity_blocks: int) -> dict[str, Any]:
    """Token hit rate of one LRU of ``capacity_blocks`` 16-token blocks over the stream."""
    cache: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    hits = queries = infinite_hits = evictions = 0
    for job in jobs:
        tokens = ["<bos>", *prompt_words(job)]
        n = len(tokens)
        chain: list[int] = []
        h = 0
        for b in range(n // KV_BLOCK):
            h = hash((h, *tokens[b * KV_BLOCK : (b + 1) * KV_BLOCK]))
            chain.append(h)
        usable = (n - 1) // KV_BLOCK
        matched = 0
        while matched < usable and chain[matched] in cache:
            matched += 1
        inf = 0
        while inf < usable and chain[inf] in seen:
            inf += 1
        hits += matched * KV_BLOCK
        infinite_hits += inf * KV_BLOCK
        queries += n
        for key in reversed(chain):  # tail first, root last: the root is the most recent
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
                    evictions += 1
            seen.add(key)
    return {
        "capacity_blocks": capacity_blocks,
        "hit_rate": hits / queries,
        "infinite_cache_hit_rate": infinite_hits / queries,
        "distinct_blocks": len(seen),
        "evictions": evictions,
        "filled": evictions > 0,
        "queries": queries,
    }


# -- the fleet ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fleet_file(where: Path, policy: str, replicas: int, port: int, time_scale: float) -> Path:
    path = where / f"fleet-{policy}.yaml"
    path.write_text(
        f"gateway:\n  host: 127.0.0.1\n  port: {port}\n"
        f"models:\n  - name: {MODEL}\n    engine: sim\n    gpu: h100-sxm\n"
        f"    replicas: {replicas}\n    routing: {policy}\n"
        f'    args: ["--time-scale", "{time_scale:g}"]\n'
    )
    return path


_REPLICA_LINE = re.compile(r"replica\s+(\S+)\s+ready\s+(http://\S+)")


def start_up(fleet: Path, run_dir: Path, port: int) -> tuple[subprocess.Popen[bytes], list[str]]:
    log_path = run_dir / "up.log"
    log = log_path.open("wb")
    exe = Path(sys.executable).parent / "gpufleet"
    proc = subprocess.Popen(
        [str(exe), "up", "--fleet", str(fleet), "--run-dir", str(run_dir / "run")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "GPUFLEET_HOME": str(run_dir / "home")},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gpufleet up exited: {log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                urls = [m.group(2) for m in _REPLICA_LINE.finditer(log_path.read_text())]
                return proc, urls
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("gateway not ready after 120 s")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total",
            "gpufleet:sim_engine_lag_seconds_total",
        ):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm:cache_config_info"):
            m = re.search(r'num_gpu_blocks="(\d+)"', line)
            if m:
                out["num_gpu_blocks"] = float(m.group(1))
    return out


# -- the load --------------------------------------------------------------------------------


async def send(port: int, job: Job) -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": " ".join(prompt_words(job)),
            "max_tokens": job.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    job.sent = time.perf_counter()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head_seen = False
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        if not head_seen:
            head_seen = True
            if not data.startswith(b"HTTP/1.1 200"):
                job.error = data[:200].decode(errors="replace")
                break
        seen = tail + data
        if job.first is None and b"data: {" in seen:
            job.first = now
        if b"data: [DONE]" in seen:
            job.done = now
            break
        tail = seen[-16:]
    writer.close()
    if job.error is None and job.done is None:
        job.error = "stream ended without [DONE]"


async def replay(port: int, jobs: list[Job]) -> float:
    start = time.perf_counter() + 0.5

    async def one(job: Job) -> None:
        await asyncio.sleep(max(0.0, start + job.at - time.perf_counter()))
        try:
            await send(port, job)
        except OSError as error:
            job.error = str(error)

    async with asyncio.TaskGroup() as group:
        for job in jobs:
            group.create_task(one(job))
    return start


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")


def run_policy(
    args: argparse.Namespace, policy: str, stream: list[Job], where: Path
) -> PolicyResult:
    jobs = [Job(j.at, j.hash_ids, j.words, j.max_tokens) for j in stream]
    port = free_port()
    fleet = fleet_file(where, policy, args.replicas, port, args.compress)
    run_dir = where / policy
    run_dir.mkdir()
    proc, urls = start_up(fleet, run_dir, port)
    try:
        if len(urls) != args.replicas:
            raise RuntimeError(f"expected {args.replicas} replica URLs in up.log, got {urls}")
        wall = time.perf_counter()
        start = asyncio.run(replay(port, jobs))
        wall = time.perf_counter() - wall
        time.sleep(0.3)
        scraped = [scrape(u) for u in urls]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ok = [j for j in jobs if j.error is None and j.first is not None]
    failed = [j for j in jobs if j not in ok]
    ttft = [j.first - j.sent for j in ok if j.first is not None]
    lateness = [j.sent - start - j.at for j in ok]
    result = PolicyResult(policy=policy, requests=len(jobs), failures=len(failed))
    result.hits = int(sum(s.get("vllm:prefix_cache_hits_total", 0) for s in scraped))
    result.queries = int(sum(s.get("vllm:prefix_cache_queries_total", 0) for s in scraped))
    result.prompt_tokens = [int(s.get("vllm:prompt_tokens_total", 0)) for s in scraped]
    result.num_gpu_blocks = [int(s.get("num_gpu_blocks", 0)) for s in scraped]
    result.engine_lag_s = sum(s.get("gpufleet:sim_engine_lag_seconds_total", 0) for s in scraped)
    result.ttft_ms = {
        "p50": 1e3 * quantile(ttft, 0.5),
        "p99": 1e3 * quantile(ttft, 0.99),
        "mean": 1e3 * sum(ttft) / max(1, len(ttft)),
    }
    result.send_lateness_p99_ms = 1e3 * quantile(lateness, 0.99)
    result.wall_s = wall
    if failed:
        print(f"  {policy}: {len(failed)} failed, first: {failed[0].error!r}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=1000, help="the first N trace rows")
    parser.add_argument("--compress", type=float, default=4.0, help="arrival clock ÷, = time scale")
    parser.add_argument("--max-input", type=int, default=8192, help="prompt words (tokens) cap")
    parser.add_argument("--max-output", type=int, default=32, help="max_tokens cap")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    console = Console(width=140)
    if not args.trace.exists():
        console.print(f"[red]no trace at {args.trace}[/]")
        return 1
    stream = load_slice(args.trace, args.requests, args.compress, args.max_input, args.max_output)
    # every word is one token of the engine's tokenizer (+ BOS): token prefixes = word prefixes
    sample = " ".join(prompt_words(stream[0]))
    assert len(Tokenizer(128_256).encode(sample)) == stream[0].words + 1
    span = stream[-1].at
    console.print(
        f"{len(stream)} requests, {span * args.compress:.0f} s of trace in {span:.0f} s "
        f"(×{args.compress:g}, sim time scale {args.compress:g}); prompts ≤ {args.max_input} "
        f"tokens, max_tokens ≤ {args.max_output}"
    )
    results: list[PolicyResult] = []
    with tempfile.TemporaryDirectory(prefix="gw-routing-") as tmp:
        for policy in args.policies.split(","):
            console.print(f"{policy} …")
            results.append(run_policy(args, policy, stream, Path(tmp)))
    blocks = sum(results[0].num_gpu_blocks)
    reference = pooled_lru(stream, blocks)
    ref = reference["hit_rate"]

    table = Table(
        title=f"Routing quality through the gateway: Mooncake conversation trace, first "
        f"{len(stream)} requests ({span * args.compress:.0f} s of trace, ×{args.compress:g}), "
        f"{args.replicas} sim replicas llama-3.1-8b/h100-sxm"
    )
    for column in ("policy", "hit rate", "of pooled LRU", "TTFT P50 ms", "TTFT P99 ms",
                   "prompt tok/replica max/mean", "max ÷ mean", "requests", "failed"):  # fmt: skip
        table.add_column(column, justify="left" if column == "policy" else "right")
    rows: list[dict[str, Any]] = []
    for r in results:
        mean = sum(r.prompt_tokens) / len(r.prompt_tokens)
        imbalance = max(r.prompt_tokens) / mean if mean else float("nan")
        row: dict[str, Any] = {
            "policy": r.policy,
            "requests": r.requests,
            "failures": r.failures,
            "prefix_cache_hits": r.hits,
            "prefix_cache_queries": r.queries,
            "hit_rate": r.hit_rate,
            "fraction_of_pooled_lru": r.hit_rate / ref if ref else None,
            "ttft_client_ms": r.ttft_ms,
            "ttft_modelled_ms_estimate": {k: v * args.compress for k, v in r.ttft_ms.items()},
            "prompt_tokens_per_replica": r.prompt_tokens,
            "prompt_tokens_max": max(r.prompt_tokens),
            "prompt_tokens_mean": mean,
            "max_over_mean": imbalance,
            "num_gpu_blocks_per_replica": r.num_gpu_blocks,
            "engine_lag_s": r.engine_lag_s,
            "send_lateness_p99_ms": r.send_lateness_p99_ms,
            "wall_s": r.wall_s,
        }
        rows.append(row)
        table.add_row(
            r.policy,
            f"{r.hit_rate:.1%}",
            f"{r.hit_rate / ref:.1%}" if ref else "–",
            f"{r.ttft_ms['p50']:.1f}",
            f"{r.ttft_ms['p99']:.1f}",
            f"{max(r.prompt_tokens):,} / {mean:,.0f}",
            f"{imbalance:.2f}",
            str(r.requests),
            str(r.failures),
        )
    table.add_row(
        "pooled LRU",
        f"{ref:.1%}",
        "100%",
        "",
        "",
        "",
        "",
        str(len(stream)),
        "",
    )
    console.print(table)
    console.print(
        f"pooled LRU: {blocks:,} blocks of 16 tokens ({args.replicas} × "
        f"{results[0].num_gpu_blocks[0]:,}), {reference['distinct_blocks']:,} distinct blocks in "
        f"the stream, {'filled (' + format(reference['evictions'], ',') + ' evictions)' if reference['filled'] else 'never filled: the reference is the infinite-cache reuse'}; "  # noqa: E501
        f"infinite cache {reference['infinite_cache_hit_rate']:.1%}"
    )
    console.print(
        "TTFT is client-side real time; the replicas run at time scale "
        f"{args.compress:g}, so × {args.compress:g} ≈ modelled ms (the HTTP edge scaled too)"
    )
    pa = next((row for row in rows if row["policy"] == "prefix_aware"), None)
    bar = None
    if pa is not None and ref:
        bar = {
            "hit_rate_fraction": pa["fraction_of_pooled_lru"],
            "max_over_mean": pa["max_over_mean"],
            "met": pa["fraction_of_pooled_lru"] >= 0.8 and pa["max_over_mean"] <= 1.5,
        }
        console.print(
            f"bar (prefix_aware ≥ 80 % of pooled LRU, max replica ≤ 1.5 × mean prompt tokens): "
            f"{bar['hit_rate_fraction']:.1%}, {bar['max_over_mean']:.2f}× → "
            f"{'met' if bar['met'] else 'NOT met'}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bench": "gateway_routing_quality",
                "command": "python bench/gateway_routing_quality.py "
                + " ".join(sys.argv[1:] if argv is None else argv),
                "machine": {
                    "python": sys.version.split()[0],
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                },
                "trace": args.trace.name,
                "slice": {
                    "first_requests": len(stream),
                    "trace_seconds": span * args.compress,
                    "replay_seconds": span,
                    "compress": args.compress,
                    "sim_time_scale": args.compress,
                    "max_input_tokens": args.max_input,
                    "max_output_tokens": args.max_output,
                    "prompt_tokens_total": sum(j.words + 1 for j in stream),
                },
                "fleet": {
                    "replicas": args.replicas,
                    "model": MODEL,
                    "gpu": "h100-sxm",
                    "engine_args": ["--time-scale", f"{args.compress:g}"],
                },
                "pooled_lru": reference,
                "results": rows,
                "bar": bar,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
