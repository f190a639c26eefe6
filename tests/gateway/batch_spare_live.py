"""Batch lines on spare capacity, live: interactive clients beside a batch, through the real
gateway over sim engine processes.

Used by ``tests/gateway/test_batch_spare_live.py`` and ``bench/batch_spare_capacity.py``.
Sim replicas run as ``gpufleet engine sim`` child processes (real time scaled by
``time_scale``); the gateway has auth on (keys and the batch in a real SQLite store); the
interactive tenant streams ``/v1/chat/completions`` at Poisson times from its own client
process (``fairness_client.py``), which measures time to the first content chunk. Three
phases, the same request shape throughout (``words`` prompt words, ``tokens`` answer
tokens):

1. capacity: a batch alone with no gate, twice the slots offered at once (the fleet full):
   lines completed per second;
2. interactive alone at ``load`` × capacity (Poisson, ``duration`` s), gate on;
3. the same interactive plan beside a batch of ``lines`` lines (created ``ramp`` s before),
   gate on: the batch's lines completed per second while the interactive plan runs.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.control import PoolController
from gpufleet.store import TenantSettings
from tests.gateway.batches import CHAT, BatchGateway, input_lines, serve_batch_gateway, upload
from tests.gateway.conftest import MODEL
from tests.gateway.fairness_live import Outcome, _client, replica_process

COMPLETED = "gpufleet:gateway_batch_lines_total"


def spare_fleet(seqs: int, lines_in_flight: int, spare: dict[str, Any] | None) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {"name": MODEL, "routing": "least_request", "args": [f"--max-num-seqs={seqs}"]}
            ],
            "gateway": {
                "scrape_interval": 0.1,
                "batch": {
                    "lines_in_flight": lines_in_flight,
                    "poll_interval": 0.2,
                    "max_backoff": 1.0,
                    "spare": spare,
                },
            },
            "tenants": {"auth": True, "refresh_interval": 0.2, "admission": {"max_wait": 60.0}},
        }
    )


class PoolWatch:
    """The pool controller's counts, sampled every 20 ms on a thread while a phase runs."""

    def __init__(self, pool: PoolController) -> None:
        self.pool = pool
        self.rows: list[tuple[float, int, int, int, float]] = []
        """(seconds, in flight, batch in flight, gated, gate limit)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        pool = self.pool
        while not self._stop.wait(0.02):
            limit = pool.spare.limit if pool.spare is not None else 0.0
            self.rows.append(
                (
                    round(time.monotonic() - start, 3),
                    pool.in_flight,
                    pool.batch_in_flight,
                    pool.gated,
                    limit,
                )
            )

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def most(self, column: int) -> float:
        return max((row[column] for row in self.rows), default=0)


def _interactive(  # noqa: PLR0917
    gw: BatchGateway, key: str, rate: float, duration: float, seed: int, words: int, tokens: int
) -> Outcome:
    rng = random.Random(f"chat-{seed}")
    t, plan = 0.0, []
    while (t := t + rng.expovariate(rate)) < duration:
        plan.append((t, "chat", key))
    job = {
        "url": gw.url, "model": MODEL, "start_at": time.time() + 1.0, "words": words,
        "tokens": tokens, "plan": plan,
    }  # fmt: skip
    seen = asyncio.run(_client(job))["chat"]
    return Outcome(seen["ttft"], {int(code): n for code, n in seen["statuses"].items()})


def _batch(client: openai.OpenAI, lines: int, words: int, tokens: int) -> str:
    prompt = " ".join(["word"] * words)
    data = input_lines(lines, max_tokens=tokens).replace(b'"line ', f'"{prompt} '.encode())
    file_id = upload(client, data)
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def _rate(gw: BatchGateway, seconds: float) -> float:
    before = gw.sample(COMPLETED, outcome="completed")
    time.sleep(seconds)
    return (gw.sample(COMPLETED, outcome="completed") - before) / seconds


def _capacity(  # noqa: PLR0917
    tmp: Path,
    urls: list[str],
    seqs: int,
    lines: int,
    shape: tuple[int, int],
    times: tuple[float, float],
) -> float:
    """Lines completed per second by a batch alone with no gate, twice the slots offered
    (the rest waits at the gateway): the fleet full."""
    slots = len(urls) * seqs
    with serve_batch_gateway(tmp, spare_fleet(seqs, 2 * slots, None), urls) as gw:
        _, key = gw.store.create_key("nightly", TenantSettings())
        assert gw.tenancy is not None
        gw.tenancy.reload()
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            batch_id = _batch(client, max(lines, 4 * slots), *shape)
            time.sleep(times[0])
            capacity = _rate(gw, times[1])
            client.batches.cancel(batch_id)
    return capacity


def run_spare(
    tmp: Path,
    *,
    replicas: int = 2,
    max_num_seqs: int = 16,
    time_scale: float = 0.25,
    words: int = 100,
    tokens: int = 48,
    load: float = 0.5,
    duration: float = 30.0,
    lines: int = 5000,
    capacity_s: float = 10.0,
    ramp: float = 3.0,
    spares: tuple[dict[str, Any], ...] = ({},),
    seed: int = 0,
) -> dict[str, Any]:
    """Capacity, interactive alone (twice: before and after, the noise between two equal
    runs), and beside a batch once per gate setting in ``spares``."""
    slots = replicas * max_num_seqs
    shape = (words, tokens)
    with ExitStack() as stack:
        urls = [
            stack.enter_context(replica_process(max_num_seqs, time_scale, seed + i))
            for i in range(replicas)
        ]
        (tmp / "capacity").mkdir()
        capacity = _capacity(tmp / "capacity", urls, max_num_seqs, lines, shape, (ramp, capacity_s))
        rate = load * capacity
        runs: list[dict[str, Any]] = []
        alone: list[Outcome] = []
        for i, spare in enumerate(spares):
            (tmp / f"gated-{i}").mkdir()
            config = spare_fleet(max_num_seqs, 2 * slots, spare)
            with serve_batch_gateway(tmp / f"gated-{i}", config, urls) as gw:
                assert gw.tenancy is not None
                _, chat = gw.store.create_key("chat", TenantSettings())
                _, nightly = gw.store.create_key("nightly", TenantSettings())
                gw.tenancy.reload()
                pool = gw.app.control.pools[MODEL]
                if i == 0:
                    alone.append(_interactive(gw, chat, rate, duration, seed, *shape))
                with openai.OpenAI(base_url=gw.v1, api_key=nightly, max_retries=0) as client:
                    batch_id = _batch(client, lines, *shape)
                    time.sleep(ramp)
                    with PoolWatch(pool) as watch:
                        before = gw.sample(COMPLETED, outcome="completed")
                        t0 = time.monotonic()
                        both = _interactive(gw, chat, rate, duration, seed, *shape)
                        window = time.monotonic() - t0
                        done = gw.sample(COMPLETED, outcome="completed") - before
                    client.batches.cancel(batch_id)
                if i == len(spares) - 1:
                    alone.append(_interactive(gw, chat, rate, duration, seed, *shape))
                gated, recalled = pool.counters.gated, pool.counters.recalled
            assert config.gateway.batch.spare is not None
            runs.append(
                {
                    "spare": config.gateway.batch.spare.model_dump(),
                    "interactive": both.summary(),
                    "batch_lines_in_window": int(done),
                    "window_s": round(window, 2),
                    "batch_rps": round(done / window, 3),
                    "gated": gated,
                    "recalled": recalled,
                    "batch_in_flight_max": watch.most(2),
                    "in_flight_max": watch.most(1),
                    "series": watch.rows,
                    "_ttft": both,
                }
            )
    served = len(alone[0].ttft) / duration
    idle = capacity - served
    base = alone[0].p(0.99)
    for run in runs:
        with_batch = run.pop("_ttft").p(0.99)
        run["ttft_p99_ratio"] = (
            None if not base or with_batch is None else round(with_batch / base, 3)
        )
        run["batch_share_of_idle"] = None if idle <= 0 else round(run["batch_rps"] / idle, 3)
    again = alone[-1].p(0.99)
    return {
        "inputs": {
            "replicas": replicas,
            "max_num_seqs": max_num_seqs,
            "time_scale": time_scale,
            "prompt_words": words,
            "max_tokens": tokens,
            "load": load,
            "duration_s": duration,
            "batch_lines": lines,
            "capacity_s": capacity_s,
            "ramp_s": ramp,
            "seed": seed,
        },
        "slots": slots,
        "capacity_rps": round(capacity, 3),
        "interactive_rate_rps": round(rate, 3),
        "interactive_served_rps": round(served, 3),
        "idle_capacity_rps": round(idle, 3),
        "interactive_alone": [o.summary() for o in alone],
        "alone_again_p99_ratio": None if not base or again is None else round(again / base, 3),
        "with_batch": runs,
    }
