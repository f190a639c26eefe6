"""Batch lines in prefix order vs the file's order, live: the engines' prefix-cache hit rate
and the batch's run time (issue 17: "lines are ordered to share prefixes").

    PYTHONPATH=src:. .venv/bin/python bench/batch_prefix_order.py   # ~2 min on 2 cores

Two sim engine processes (``gpufleet engine sim``: ``--max-num-seqs 8``, a KV cache of
``--num-gpu-blocks-override`` blocks, time scale 4) behind the gateway (auth on, a real
SQLite store, ``prefix_aware`` routing). One batch file: ``lines`` chat lines, each with one
of ``prompts`` long system prompts (``words`` words), in a shuffled order, and a short
question of its own. It runs twice, once per ``batch.order``: ``input`` (the file's order)
and ``prefix`` (the default: sorted by prompt text). Read from the engines' own metrics:
``vllm:prefix_cache_hits_total`` ÷ ``vllm:prefix_cache_queries_total`` over the run.
Writes ``bench/results/batch_prefix_order.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
from rich.console import Console
from rich.table import Table
from tests.gateway.batches import CHAT, serve_batch_gateway, upload, wait_ended
from tests.gateway.conftest import MODEL
from tests.up_process import sim_engine_process

from gpufleet.config import parse_fleet
from gpufleet.store import TenantSettings

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "batch_prefix_order.json"


def batch_file(lines: int, prompts: int, words: int, tokens: int, seed: int) -> bytes:
    rng = random.Random(seed)
    systems = [" ".join(f"rule{k}-{w}" for w in range(words)) for k in range(prompts)]
    which = [i % prompts for i in range(lines)]
    rng.shuffle(which)
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": systems[k]},
                        {"role": "user", "content": f"question {i}"},
                    ],
                    "max_tokens": tokens,
                },
            }
        ).encode()
        + b"\n"
        for i, k in enumerate(which)
    )


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(queries, hits) summed over the engines' ``/metrics``."""
    queries = hits = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics").text
        for name, value in re.findall(
            r"^(vllm:prefix_cache_\w+_total)\{[^}]*\} (\S+)$", text, re.M
        ):
            if name == "vllm:prefix_cache_queries_total":
                queries += float(value)
            elif name == "vllm:prefix_cache_hits_total":
                hits += float(value)
    return queries, hits


def run(tmp: Path, urls: list[str], order: str, data: bytes) -> dict[str, Any]:
    fleet = parse_fleet(
        {
            "models": [{"name": MODEL, "routing": "prefix_aware", "args": ["--max-num-seqs=8"]}],
            "gateway": {"batch": {"order": order, "poll_interval": 0.1, "lines_in_flight": 32}},
            "tenants": {"auth": True, "refresh_interval": 0.2},
        }
    )
    with serve_batch_gateway(tmp, fleet, urls) as gw:
        _, key = gw.store.create_key("nightly", TenantSettings())
        assert gw.tenancy is not None
        gw.tenancy.reload()
        before = cache_counts(urls)
        start = time.monotonic()
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            file_id = upload(client, data)
            batch = client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            done = wait_ended(client, batch.id, timeout=600.0)
        took = time.monotonic() - start
        after = cache_counts(urls)
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None
    assert counts.completed == counts.total
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "order": order,
        "lines": counts.total,
        "seconds": round(took, 2),
        "lines_per_s": round(counts.total / took, 2),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": round(hits / queries, 4) if queries else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=400, help="KV blocks per engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = batch_file(args.lines, args.prompts, args.words, args.tokens, args.seed)
    runs = []
    for order in ("input", "prefix"):
        engine = ["--max-num-seqs", "8", "--num-gpu-blocks-override", str(args.blocks),
                  "--time-scale", "4", "--max-model-len", "4096"]  # fmt: skip
        with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
            # fresh engines per run: neither starts with the other's cache
            urls = [
                stack.enter_context(sim_engine_process(*engine, "--seed", str(i))) for i in range(2)
            ]
            runs.append(run(Path(tmp), urls, order, data))
    result = {"inputs": vars(args), "runs": runs}
    first, second = runs
    result["hit_rate_ratio"] = (
        None if not first["hit_rate"] else round(second["hit_rate"] / first["hit_rate"], 3)
    )
    result["speedup"] = round(first["seconds"] / second["seconds"], 3)
    table = Table(title="one batch, two run orders")
    for col in ("order", "lines", "seconds", "lines/s", "prefix-cache hit rate"):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            r["order"], str(r["lines"]), str(r["seconds"]), str(r["lines_per_s"]),
            str(r["hit_rate"]),
        )  # fmt: skip
    Console().print(table)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, RESULT.with_suffix(".png"))
    print(f"wrote {RESULT} and {RESULT.with_suffix('.png')}")


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the bench draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["order"] for r in runs]
    left.bar(names, [r["hit_rate"] for r in runs], color=["tab:grey", "tab:blue"])
    left.set_ylabel("engines' prefix-cache hit rate")
    left.set_ylim(0, 1)
    right.bar(names, [r["lines_per_s"] for r in runs], color=["tab:grey", "tab:blue"])
    right.set_ylabel("batch lines per second")
    fig.suptitle("batch.order: the file's order vs prompt-prefix order")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
