"""Residency live: ``gpufleet up`` wiring, two real sim engine processes whose models share
one GPU slot (only one awake at a time), the official ``openai`` client, traffic that
alternates between the two models and then mixes them. Not one request fails; every switch
is a wake (``POST /wake_up`` on the engine), not a cold start, and takes the modelled wake
time; a held request waits a bounded time; the gateway's recording replays to the same
decisions."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import httpx
import openai
import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.control import Residency, read_recording, replay
from gpufleet.perf import residency_times
from tests.control import residency_scenario as scenario
from tests.control.residency_scenario import EXPECTED, PHASES, A, B, residency_commands
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

ENGINE = ["--time-scale", "1", "--max-num-seqs", "8", "--max-model-len", "2048"]
WAKE = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm")).wake(1)
"""The modelled level-1 wake of an 8B model on an H100: ~0.41 s (time scale 1: real)."""
CLIENTS = 4
FLEET = scenario.fleet(ENGINE)


async def _client_loop(
    client: openai.AsyncOpenAI, model: str, n: int, latencies: list[tuple[str, float]]
) -> None:
    for _ in range(n):
        started = time.monotonic()
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=16
        )
        assert answer.choices[0].message.content
        latencies.append((model, time.monotonic() - started))


async def _phase(fleet: LiveFleet, models: list[str], latencies: list[tuple[str, float]]) -> None:
    async with openai.AsyncOpenAI(base_url=fleet.v1, api_key="x", max_retries=0) as client:
        await asyncio.gather(
            *(_client_loop(client, models[i % len(models)], 3, latencies) for i in range(CLIENTS))
        )


def _residency(fleet: LiveFleet, model: str) -> Residency:
    residency = fleet.gateway.control.control.residency
    assert residency is not None
    (state,) = residency.replicas_of(model).values()
    return state


@pytest.mark.asyncio
async def test_two_models_share_a_slot_taking_turns_without_a_failed_request(
    tmp_path: Path,
) -> None:
    recording = io.StringIO()
    async with live_fleet(fleet_file(FLEET), tmp_path, record=recording) as fleet:
        # the engines start awake; the slot holds one: the controller puts one to sleep
        async with asyncio.timeout(10):
            while {_residency(fleet, A), _residency(fleet, B)} != {
                Residency.SERVING,
                Residency.SLEEPING_1,
            }:
                await asyncio.sleep(0.02)
        latencies: list[tuple[str, float]] = []
        for phase in PHASES:  # alternating: every phase starts with a swap
            await _phase(fleet, phase, latencies)
        # the same decisions as simulated (tests/sim/test_residency_sim.py)
        assert residency_commands(recording.getvalue()) == EXPECTED
        await _phase(fleet, [A, B], latencies)  # mixed: turns of at least min_awake

        assert len(latencies) == 5 * CLIENTS * 3  # every request answered (none raised)
        wakes = sum(fleet.sample("gpufleet:residency_wakes_total", model=m) for m in (A, B))
        assert wakes >= 4  # at least each alternation's swap
        evictions = fleet.sample("gpufleet:residency_sleeps_total", model=A, reason="evicted")
        assert evictions >= 2
        # each wake took the modelled time (time scale 1), not a cold start
        count = sum(fleet.sample("gpufleet:residency_wake_seconds_count", model=m) for m in (A, B))
        total = sum(fleet.sample("gpufleet:residency_wake_seconds_sum", model=m) for m in (A, B))
        assert count == wakes
        assert WAKE * 0.95 <= total / count <= WAKE * 1.10
        # held time is bounded: no request waited longer than a drain, a sleep, a wake and
        # min_awake over a few hundred ms of work (the hold timeout is 20 s)
        assert max(t for _, t in latencies) < 6.0
        # the engines agree: exactly one is awake, and each was woken by POST /wake_up
        engines = {u.model: u.url for u in fleet.gateway.control.upstreams.values()}
        async with httpx.AsyncClient(timeout=5) as http:
            asleep = [
                (await http.get(f"{engines[m]}/is_sleeping")).json()["is_sleeping"] for m in (A, B)
            ]
            woken = 0.0
            for m in (A, B):
                text = (await http.get(f"{engines[m]}/metrics")).text
                line = next(
                    x for x in text.splitlines() if x.startswith("gpufleet:sim_engine_wakes_total")
                )
                woken += float(line.rsplit(" ", 1)[1])
        assert sorted(asleep) == [False, True]
        assert woken == wakes
        # the console's view says the same: one serving, one asleep (and no adapters)
        async with httpx.AsyncClient(timeout=5) as http:
            pools = (await http.get(fleet.url + "/admin/fleet")).json()["pools"]
        shown = sorted((r["residency"], r["adapters"]) for p in pools for r in p["replicas"])
        assert shown == [("serving", None), ("sleeping_1", None)]
        assert (
            fleet.sample(
                "gpufleet:replica_residency",
                model=A,
                replica=f"{A}-0",
                state=_residency(fleet, A).value,
            )
            == 1.0
        )

    head, lines = read_recording(recording.getvalue().splitlines())
    kinds: set[str] = set()
    for line, commands in replay(head, lines):
        assert commands == line.commands, line
        kinds |= {c["do"] for c in commands}
    assert {"sleep", "wake", "route"} <= kinds
