"""The fairness experiment live: two tenants' keys, a 10× heavy one, through the real gateway.

Used by ``tests/gateway/test_fairness_live.py`` and ``bench/fairness.py --live``. Sim replicas
(``gpufleet engine sim`` child processes, as engines run beside a gateway for real, so their
work does not share the gateway's interpreter; real time scaled by ``time_scale``) behind
the gateway with auth on (keys in a real SQLite store) and admission on; an asyncio client
streams ``/v1/chat/completions`` with each tenant's key at Poisson times and measures time
to the first content chunk, from one client process per tenant (``fairness_client.py``).
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import sys
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from gpufleet.control import PoolController
from gpufleet.store import TenantSettings
from gpufleet.store._schema import usage
from tests.gateway.conftest import MODEL
from tests.gateway.tenants import serve_tenant_gateway, tenant_fleet
from tests.up_process import sim_engine_process


def replica_process(max_num_seqs: int, time_scale: float, seed: int) -> AbstractContextManager[str]:
    """A sim replica as a child process; yields its URL once ``/health`` answers."""
    return sim_engine_process(
        "--max-num-seqs", str(max_num_seqs), "--time-scale", str(time_scale),
        "--max-model-len", "4096", "--seed", str(seed),
    )  # fmt: skip


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def p(self, q: float) -> float | None:
        values = sorted(self.ttft)
        return values[int(q * (len(values) - 1))] if values else None

    def summary(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 1)

        return {
            "served": len(self.ttft),
            "statuses": dict(sorted(self.statuses.items())),
            "ttft_ms": {"p50": ms(self.p(0.5)), "p99": ms(self.p(0.99))},
        }


@dataclass
class GateWatch:
    """The pool controller's queue and running count, sampled every 10 ms while a phase
    runs."""

    pool: PoolController
    queue_max: int = 0
    in_flight_max: int = 0

    async def run(self) -> None:
        while True:
            self.queue_max = max(self.queue_max, self.pool.queued)
            self.in_flight_max = max(self.in_flight_max, self.pool.in_flight)
            await asyncio.sleep(0.01)


async def _client(job: dict[str, Any]) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gateway.fairness_client",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate(json.dumps(job).encode())
    assert process.returncode == 0, f"fairness client exited {process.returncode}"
    result: dict[str, Any] = json.loads(out)
    return result


async def _send(
    url: str, plan: list[tuple[float, str, str]], words: int, tokens: int, watch: GateWatch
) -> dict[str, Outcome]:
    """Each tenant's requests from its own client process (fairness_client.py), all
    starting together a second from now (the processes import httpx meanwhile)."""
    tenants = sorted({tenant for _, tenant, _ in plan})
    start_at = time.time() + 1.0
    jobs = [
        {
            "url": url, "model": MODEL, "start_at": start_at, "words": words, "tokens": tokens,
            "plan": [step for step in plan if step[1] == tenant],
        }
        for tenant in tenants
    ]  # fmt: skip
    watcher = asyncio.create_task(watch.run())
    try:
        results = await asyncio.gather(*(_client(job) for job in jobs))
    finally:
        watcher.cancel()
    outcomes: dict[str, Outcome] = {}
    for result in results:
        for tenant, seen in result.items():
            outcomes[tenant] = Outcome(
                seen["ttft"], {int(code): n for code, n in seen["statuses"].items()}
            )
    return outcomes


def _queued_arrivals(lines: str, tenant: str) -> int:
    """``tenant``'s arrivals in a decision log that did not start at once (no route for
    them among their own event's commands)."""
    queued = 0
    for text in lines.splitlines():
        line = json.loads(text)
        event = line["event"]
        if event["kind"] != "arrived" or event["tenant"] != tenant:
            continue
        if not any(c["do"] == "route" and c["id"] == event["id"] for c in line["commands"]):
            queued += 1
    return queued


def run_live(
    tmp: Path,
    *,
    light_rate: float = 2.0,
    duration: float = 6.0,
    replicas: int = 2,
    max_num_seqs: int = 16,
    saturation: float = 0.5,
    reserve_saturation: float = 1.0,
    time_scale: float = 1.0,
    words: int = 200,
    tokens: int = 60,
    seed: int = 0,
) -> dict[str, Any]:
    """Light alone, then light + a heavy tenant at 10× its rate; each phase ``duration`` s.

    ``reserve_saturation`` at or below ``saturation``: no fair-share reserve (the contrast).
    """
    config = tenant_fleet(
        args=["--max-num-seqs", str(max_num_seqs)],
        admission={
            "max_wait": 30.0,
            "saturation": saturation,
            "reserve_saturation": reserve_saturation,
        },
    )
    with ExitStack() as stack:
        urls = [
            stack.enter_context(replica_process(max_num_seqs, time_scale, seed + i))
            for i in range(replicas)
        ]
        recording = io.StringIO()  # the controller's decisions: who started at once
        gw = stack.enter_context(serve_tenant_gateway(tmp, config, urls, record=recording))
        keys = {}
        for tenant in ("light", "heavy"):
            _, keys[tenant] = gw.store.create_key(tenant, TenantSettings())
        gw.tenancy.reload()

        def arrivals(tenant: str, rate: float) -> list[tuple[float, str, str]]:
            rng = random.Random(f"{tenant}-{seed}")
            t, out = 0.0, []
            while (t := t + rng.expovariate(rate)) < duration:
                out.append((t, tenant, keys[tenant]))
            return out

        light = arrivals("light", light_rate)
        heavy = arrivals("heavy", 10 * light_rate)
        watch_alone, watch_both = GateWatch(gw.pool), GateWatch(gw.pool)
        alone = asyncio.run(_send(gw.url, light, words, tokens, watch_alone))
        second_phase = time.time()
        first_phase_end = len(recording.getvalue())
        both = asyncio.run(_send(gw.url, sorted(light + heavy), words, tokens, watch_both))
        gw.flush()
        with gw.store.engine.connect() as db:
            rows = db.execute(
                select(usage.c.queue_s).where(
                    usage.c.tenant == "light", usage.c.time >= second_phase
                )
            ).all()
        light_queue = sorted(row.queue_s or 0.0 for row in rows)
        light_queued = _queued_arrivals(recording.getvalue()[first_phase_end:], "light")
    a, b = alone["light"].p(0.99), both["light"].p(0.99)
    return {
        "inputs": {
            "light_rate": light_rate,
            "heavy_rate": 10 * light_rate,
            "duration_s": duration,
            "replicas": replicas,
            "max_num_seqs": max_num_seqs,
            "saturation": saturation,
            "reserve_saturation": reserve_saturation,
            "time_scale": time_scale,
            "prompt_words": words,
            "max_tokens": tokens,
        },
        "light_alone": alone["light"].summary(),
        "light_with_heavy": both["light"].summary(),
        "heavy_with_light": both["heavy"].summary(),
        "gate": {
            "slots": replicas * max_num_seqs,
            "alone": {
                "queue_max": watch_alone.queue_max,
                "in_flight_max": watch_alone.in_flight_max,
            },
            "with_heavy": {
                "queue_max": watch_both.queue_max,
                "in_flight_max": watch_both.in_flight_max,
                # The light tenant's wait in the gate, from the ledger: the policy's share
                # of its TTFT (the rest is the engines and the machine).
                "light_queue_ms_max": round(max(light_queue, default=0.0) * 1000, 2),
                # light arrivals the controller queued rather than started at once
                "light_queued": light_queued,
            },
        },
        "light_ttft_p99_ratio": None if not a or b is None else round(b / a, 3),
    }
