"""Autoscaling live: ``gpufleet up`` wiring, real sim engine processes, real HTTP on loopback,
the official ``openai`` client. Load steps up, replicas join (a prewarmed standby first, then
a cold start), time to first token recovers; load steps down, replicas drain and leave, and
not one request fails.

Windows and cooldowns are seconds, not minutes, and each engine holds 4 sequences, so a
dozen concurrent streams saturate two replicas. Latency bounds are loose and relative to the
same run: the machine may be a loaded 2-core VM.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from gpufleet.fleet import ReplicaState
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

MODEL = "llama-3.1-8b"
SEQS = 4
ENGINE = ["--time-scale", "1", "--max-num-seqs", str(SEQS), "--max-model-len", "2048"]
TOKENS = 60
"""Tokens per streamed completion: about 0.4 s on a modelled H100 at time scale 1."""

STEP_FLEET = {
    "gateway": {"autoscaler": {"interval": 0.25}},
    "models": [
        {
            "name": MODEL,
            "args": ENGINE,
            "routing": "least_request",
            "health": {"active": {"interval": 0.2}},
            "startup": {"provision": 0.5, "promote": 0.2},
            "autoscale": {
                "min_replicas": 2,
                "max_replicas": 4,
                "stable_window": 4,
                "panic_window": 1,
                "scale_down_cooldown": 3,
                "prewarm": 1,
                "forecast": {"enabled": False},
            },
        }
    ],
}


@dataclass
class Load:
    """Closed-loop streaming clients; every request's start, TTFT and outcome recorded."""

    fleet: LiveFleet
    done: list[tuple[float, float]] = field(default_factory=list)
    """(start, time to first token) of each request that completed."""
    failures: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def resize(self, clients: int) -> None:
        while len(self.tasks) > clients:
            self.tasks.pop().cancel()
        while len(self.tasks) < clients:
            self.tasks.append(asyncio.create_task(self._client(len(self.tasks))))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def ttft(self, since: float, until: float = float("inf")) -> list[float]:
        return [t for s, t in self.done if since <= s < until]

    async def _client(self, n: int) -> None:
        client = openai.AsyncOpenAI(base_url=self.fleet.v1, api_key="none", max_retries=0)
        async with client:
            i = 0
            while True:
                i += 1
                await self._one(client, f"client {n} request {i}: tell me a story")

    async def _one(self, client: openai.AsyncOpenAI, prompt: str) -> None:
        start = time.monotonic()
        first = None
        tokens, finish = 0, None
        try:
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if first is None:
                    first = time.monotonic() - start
                tokens += 1
                finish = chunk.choices[0].finish_reason or finish
        except asyncio.CancelledError:
            raise  # the step down cancels a client: not a failure of the fleet
        except Exception as error:
            self.failures.append(f"{type(error).__name__}: {error}")
            return
        if finish != "length" or first is None:
            self.failures.append(f"stream ended with {finish!r} after {tokens} chunks")
            return
        self.done.append((start, first))


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


@pytest.mark.asyncio
async def test_load_steps_up_replicas_join_slo_recovers_and_step_down_drains_without_failure(
    tmp_path: Path,
) -> None:
    config = fleet_file(STEP_FLEET)
    async with live_fleet(config, tmp_path) as fleet:
        await fleet.routable(MODEL, 2)
        assert len(fleet.runtime.snapshot.standbys(MODEL)) == 1
        load = Load(fleet)
        try:
            load.resize(2)
            await asyncio.sleep(2.0)

            # step up: 14 streams on 2 × 4 sequences; the pool panics and grows to its max
            step_up = time.monotonic()
            load.resize(14)
            await fleet.routable(MODEL, 4, timeout=30)
            lag = time.monotonic() - step_up
            assert fleet.sample("gpufleet:autoscale_actions_total", model=MODEL, action="promote")
            await asyncio.sleep(5.0)
            late = time.monotonic()
            await asyncio.sleep(4.0)
            recovered = load.ttft(late, time.monotonic())
            overloaded = load.ttft(step_up, step_up + lag)

            # step down: the pool shrinks one step per cooldown back to min_replicas, each
            # leaver drained while the two remaining clients keep streaming
            load.resize(2)
            await fleet.until(
                lambda s: (
                    len([r for r in s.replicas if not r.standby]) == 2
                    and all(r.state is ReplicaState.READY for r in s.replicas)
                ),
                timeout=40,
            )
            await asyncio.sleep(0.5)
        finally:
            await load.stop()
        drained = fleet.sample(
            "gpufleet:runtime_replica_drains_total", pool=MODEL, outcome="drained"
        )
        timed_out = fleet.sample(
            "gpufleet:runtime_replica_drains_total", pool=MODEL, outcome="drain_timeout"
        )
        lags = fleet.sample("gpufleet:autoscale_scale_up_lag_seconds_sum", model=MODEL)
        print(
            f"\nstep-up: 2 -> 4 routable in {lag:.2f} s (autoscaler lag sum {lags:.2f} s); "
            f"TTFT p90 overloaded {p90(overloaded) if len(overloaded) > 1 else float('nan'):.3f} s"
            f" ({len(overloaded)}), recovered {p90(recovered):.3f} s ({len(recovered)}); "
            f"requests {len(load.done)}, drains {drained:.0f} (timeouts {timed_out:.0f})"
        )
    assert load.failures == []
    assert len(load.done) > 100
    assert drained >= 2
    assert timed_out == 0
    # the SLO recovered: late requests' P90 TTFT well under the service time of one request
    assert len(recovered) > 20
    assert p90(recovered) < 0.3


def zero_pool(name: str, provision: float) -> dict[str, object]:
    return {
        "name": name,
        "model": MODEL,
        "args": ENGINE,
        "health": {"active": {"interval": 0.2}},
        "startup": {"provision": provision, "promote": 0.2},
        "autoscale": {
            "scale_to_zero": True,
            "min_replicas": 0,
            "max_replicas": 2,
            "stable_window": 2,
            "panic_window": 0.5,
            "scale_down_cooldown": 1,
            "idle_time": 1,
            "forecast": {"enabled": False},
        },
    }


ZERO_FLEET = {
    "gateway": {
        "retry_after": 2,
        "autoscaler": {"interval": 0.25, "hold_requests": 2, "hold_timeout": 10},
    },
    # "warm" cold-starts in about a second; "slow" takes a minute to provision
    "models": [zero_pool("warm", provision=0.0), zero_pool("slow", provision=60.0)],
}


async def complete(fleet: LiveFleet, model: str) -> tuple[int, str | None, float]:
    """One completion: (status, Retry-After, seconds)."""
    start = time.monotonic()
    client = openai.AsyncOpenAI(base_url=fleet.v1, api_key="none", max_retries=0)
    async with client:
        try:
            await client.completions.create(model=model, prompt="Hello", max_tokens=5)
        except openai.APIStatusError as error:
            retry = error.response.headers.get("retry-after")
            return error.status_code, retry, time.monotonic() - start
    return 200, None, time.monotonic() - start


@pytest.mark.asyncio
async def test_scale_from_zero_holds_requests_then_serves_and_503s_past_the_bound(
    tmp_path: Path,
) -> None:
    config = fleet_file(ZERO_FLEET)
    async with live_fleet(config, tmp_path) as fleet:
        assert fleet.runtime.snapshot.replicas == ()
        warm = asyncio.create_task(complete(fleet, "warm"))
        slow = [asyncio.create_task(complete(fleet, "slow")) for _ in range(2)]
        async with asyncio.timeout(10):
            while fleet.sample("gpufleet:autoscale_held_requests", model="slow") < 2:
                await asyncio.sleep(0.02)
        # the hold queue of "slow" is full: one more is refused at once
        full = await complete(fleet, "slow")
        assert full[:2] == (503, "2")
        assert full[2] < 1.0

        # held at zero, the request cold-started a replica and was served by it
        status, _, cold_start = await warm
        assert status == 200
        assert fleet.sample("gpufleet:autoscale_held_total", model="warm", outcome="served") == 1
        cold = fleet.sample(
            "gpufleet:autoscale_decisions_total",
            model="warm",
            direction="up",
            bound_by="cold_start",
        )
        assert cold >= 1

        # nothing is ready for "slow" within the hold timeout: 503 with Retry-After
        for status, retry, waited in await asyncio.gather(*slow):
            assert (status, retry) == (503, "2")
            assert waited >= 9.5
        assert fleet.sample("gpufleet:autoscale_held_total", model="slow", outcome="timeout") == 2
        assert fleet.sample("gpufleet:autoscale_held_total", model="slow", outcome="full") == 1

        # idle for idle_time: "warm" goes back to zero (drained, stopped)
        await fleet.until(lambda s: not [r for r in s.replicas if r.pool == "warm"], timeout=20)
        print(f"\nscale from zero: the held request was served after {cold_start:.2f} s")
