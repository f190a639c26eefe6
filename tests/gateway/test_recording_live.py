"""Record live, replay exactly: the gateway drives the pool controller, and a recording of its
events fed to a fresh controller (``gpufleet replay``, another process) gives every decision
it made live, byte for byte.

The scenario is the issue's: arrivals through the real gateway (auth and admission on) to
real sim engine processes on loopback, started and restarted by the local runtime, with
admission queueing (a pool whose slots are all taken), a slow replica (its steps 4×
slower), a crash and restart (the runtime gives the new process a new address), and an
autoscaled scale-up. The replay runs in a child process, so a decision that hung on
something outside the events (a clock, hash order) would show as a difference.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpufleet.fleet import ReplicaState
from gpufleet.gateway import Tenancy
from gpufleet.store import Store, TenantSettings
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

MODEL = "llama-3.1-8b"
ENGINE = ["--time-scale", "1", "--max-num-seqs", "4", "--max-model-len", "2048", "--enable-admin"]
FLEET = {
    # the batch gate's TTFT guard on: each Finished carries the request's TTFT
    "gateway": {
        "autoscaler": {"interval": 0.25},
        "scrape_interval": 0.1,
        "batch": {"spare": {"ttft_margin": 0.1, "ttft_samples": 5}},
    },
    "tenants": {
        "auth": True,
        "refresh_interval": 0.5,
        "admission": {"saturation": 1.0, "reserve_saturation": 1.0, "max_wait": 30},
    },
    "models": [
        {
            "name": MODEL,
            "args": ENGINE,
            "routing": "least_request",
            "health": {"active": {"interval": 0.2}},
            "startup": {"provision": 0.3},
            "autoscale": {
                "min_replicas": 2,
                "max_replicas": 3,
                "stable_window": 2,
                "panic_window": 1,
                "scale_down_cooldown": 60,
                "forecast": {"enabled": False},
            },
        }
    ],
}
REQUESTS = 120
GAP_S = 0.05
TOKENS = 100
"""20 requests a second of 100 tokens each against about 11 that the two first replicas can
serve (4 sequences each, about 0.7 s a request)."""


async def _faults(url: str, **faults: Any) -> None:
    async with httpx.AsyncClient() as http:
        (await http.post(url + "/admin/faults", json=faults, timeout=2)).raise_for_status()


async def _scenario(fleet: LiveFleet, key: str) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    client = openai.AsyncOpenAI(base_url=fleet.v1, api_key=key, max_retries=0, timeout=60)

    async def one(i: int) -> None:
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=f"request {i}: tell me a story",
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                pass
            outcomes["ok"] += 1
        except openai.APIStatusError as error:
            outcomes[str(error.status_code)] += 1
        except openai.APIError as error:  # a stream the crash broke (issue 14 resumes them)
            outcomes[type(error).__name__] += 1

    serving = [r for r in fleet.runtime.snapshot.replicas if not r.standby]
    slow, doomed = serving[0], serving[1]
    assert slow.url is not None
    assert doomed.url is not None
    async with client:
        tasks = []
        for i in range(REQUESTS):
            if i == 20:
                await _faults(slow.url, slowdown=4.0)
            if i == 50:
                await _faults(doomed.url, crash_after_s=0)
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(GAP_S)
        await asyncio.gather(*tasks)

    def restarted(snapshot: Any) -> bool:
        now = {r.name: r for r in snapshot.replicas}
        again = now.get(doomed.name)
        up = again is not None and again.state is ReplicaState.READY
        return up and again.url not in (None, doomed.url)

    await fleet.until(restarted, timeout=30)
    await fleet.routable(MODEL, len(fleet.runtime.snapshot.ready(MODEL)))
    return outcomes


@pytest.mark.asyncio
async def test_a_live_run_replays_to_the_decisions_it_made(tmp_path: Path) -> None:
    config = fleet_file(FLEET)
    store = Store.open(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    tenancy = Tenancy(config, store, journal=store.journal(tmp_path / "journal"))
    _, key = store.create_key("team", TenantSettings())
    recording = tmp_path / "recording.jsonl"
    try:
        with recording.open("w", encoding="utf-8") as out:
            async with live_fleet(config, tmp_path / "run", tenancy=tenancy, record=out) as fleet:
                outcomes = await _scenario(fleet, key)
    finally:
        store.close()
    assert outcomes["ok"] >= REQUESTS * 0.8, outcomes

    lines = [json.loads(line) for line in recording.read_text().splitlines()[1:]]
    events = Counter(line["event"]["kind"] for line in lines)
    assert events["arrived"] == sum(outcomes.values())
    # admission queued some: an arrival whose route came with a later event
    routed_at_once = {
        c["id"]
        for line in lines
        if line["event"]["kind"] == "arrived"
        for c in line["commands"]
        if c["do"] == "route" and c["id"] == line["event"]["id"]
    }
    assert events["arrived"] - len(routed_at_once) > 5
    # the crash: failed attempts or probes, and the replica back under a new address
    assert events["failed"] + events["probe"] > 0
    incarnations = {
        (r[0], r[2]) for line in lines if line["event"]["kind"] == "replicas"
        for r in line["event"]["replicas"] if r[2] is not None
    }  # fmt: skip
    assert len(incarnations) > len({name for name, _ in incarnations})
    # the TTFT of each answered request, measured live, recorded with its end
    timed = [line["event"] for line in lines if line["event"]["kind"] == "finished"]
    assert sum(e.get("ttft") is not None for e in timed) >= outcomes["ok"] * 0.9
    assert all(0 < e["ttft"] < 60 for e in timed if "ttft" in e)
    # the scale-up
    scales = [c for line in lines for c in line["commands"] if c["do"] == "scale"]
    assert any(c["direction"] == "up" for c in scales)

    replayed = subprocess.run(
        [sys.executable, "-m", "gpufleet", "replay", str(recording)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert replayed.returncode == 0, replayed.stderr
    assert "every decision equals the recorded one" in replayed.stderr
