"""A replica crashes, hangs, turns slow or answers 500s while a steady load runs.

Three sim replicas (uvicorn threads, one a subprocess for the crash) behind the gateway; an
open-loop load of short non-streaming completions (~20/s) runs for a few seconds while the
test switches a fault on (and off) through the sim engine's ``POST /admin/faults``. Every
request must succeed, none may wait past its timeout, and the bad replica must leave the
routing view within a few seconds (and come back once it recovers).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ReplicaState
from tests.gateway.conftest import MODEL, Running, fleet, serve_app, serve_gateway
from tests.up_process import sim_engine_process

RATE = 20.0
"""Requests per second of the steady load."""
FIRST_BYTE = 0.6
"""The gateway's first-byte timeout (a whole answer, for non-streaming requests)."""
CLIENT_BOUND = 2 * FIRST_BYTE + 0.6
"""No request may take longer: one timed-out attempt, one good one, and slack for 2 cores."""
HEALTH = {
    "active": {
        "interval": 0.2,
        "timeout": 0.3,
        "healthy_threshold": 1,
        "unhealthy_threshold": 2,
    },
    "outlier": {
        "consecutive_5xx": 3,
        "consecutive_local_origin_failure": 2,
        "base_ejection_time": 1.0,
        "max_ejection_percent": 34,
    },
}


@contextmanager
def admin_replica(time_scale: float = 200.0, seed: int = 0) -> Iterator[str]:
    """A sim replica in a thread with ``/admin/faults`` on."""
    config = SimEngineConfig(
        time_scale=time_scale, max_model_len=4096, seed=seed, enable_admin=True
    )
    with serve_app(create_app(config)) as url:
        yield url


def replica_process() -> AbstractContextManager[str]:
    """A sim replica as a child process (it can crash without taking the test along)."""
    return sim_engine_process(
        "--enable-admin", "--time-scale", "200", "--max-model-len", "4096", timeout=20
    )


def set_faults(url: str, **faults: Any) -> None:
    httpx.post(url + "/admin/faults", json=faults, timeout=2).raise_for_status()


@dataclass
class Load:
    """What the steady load saw: each request's status and duration, and each replica's
    routing state over time."""

    results: list[tuple[float, int, float]] = field(default_factory=list)
    """(sent at, status, seconds) per request; status 0 for a transport error."""
    states: list[tuple[float, dict[str, ReplicaState]]] = field(default_factory=list)

    def first_time(self, replica: str, states: frozenset[ReplicaState], after: float) -> float:
        """When ``replica`` was first seen in one of ``states`` at or after ``after``."""
        for at, seen in self.states:
            if at >= after and seen.get(replica) in states:
                return at
        raise AssertionError(f"{replica} never in {set(states)} after {after:.2f}")


def run_load(
    gw: Running,
    seconds: float,
    events: list[tuple[float, Callable[[], None]]],
    *,
    max_tokens: int = 4,
) -> Load:
    """``RATE`` requests per second for ``seconds``, calling each ``(at, action)`` of
    ``events`` (in a thread) at its time; times are seconds from the start."""
    load = Load()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with (
            httpx.AsyncClient(base_url=gw.v1, timeout=10, limits=limits) as http,
            asyncio.TaskGroup() as tg,
        ):

            async def one(i: int) -> None:
                sent = loop.time()
                body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": max_tokens}
                try:
                    status = (await http.post("/completions", json=body)).status_code
                except httpx.TransportError:
                    status = 0
                load.results.append((sent - start, status, loop.time() - sent))

            async def watch() -> None:
                while True:
                    pools = gw.app.control.pools.values()
                    seen = {r.id: r.state for p in pools for r in p.view.replicas()}
                    load.states.append((loop.time() - start, seen))
                    await asyncio.sleep(0.05)

            async def act(at: float, action: Callable[[], None]) -> None:
                await asyncio.sleep(at)
                await asyncio.to_thread(action)

            watcher = tg.create_task(watch())
            actions = [tg.create_task(act(at, action)) for at, action in events]
            for i in range(int(seconds * RATE)):
                await asyncio.sleep(max(0.0, start + i / RATE - loop.time()))
                tg.create_task(one(i))
            await asyncio.gather(*actions)
            while len(load.results) < int(seconds * RATE):
                await asyncio.sleep(0.05)
            watcher.cancel()

    asyncio.run(main())
    return load


def assert_all_served(load: Load, bound: float = CLIENT_BOUND) -> None:
    failed = [(round(at, 2), status) for at, status, _ in load.results if status != 200]
    assert not failed, f"requests failed: {failed}"
    slowest = max(took for _, _, took in load.results)
    assert slowest < bound, f"a request took {slowest:.2f} s"


def served(gw: Running, replica: str) -> float:
    return gw.sample("gpufleet:gateway_upstream_attempts_total", replica=replica, outcome="success")


OUT = frozenset({ReplicaState.EJECTED, ReplicaState.FAILED})
IN = frozenset({ReplicaState.READY})


def test_a_crashed_replica_is_retried_around_and_ejected() -> None:
    config = fleet(
        routing="least_request", health=HEALTH, gateway={"timeouts": {"first_byte": FIRST_BYTE}}
    )
    with (
        replica_process() as doomed,
        admin_replica(seed=1) as a,
        admin_replica(seed=2) as b,
        serve_gateway(config, [doomed, a, b]) as gw,
    ):
        crash_at = 1.0
        load = run_load(gw, 3.0, [(crash_at, lambda: set_faults(doomed, crash_after_s=0))])
    assert_all_served(load)
    out = load.first_time(f"{MODEL}-0", OUT, after=crash_at)
    assert out - crash_at < 2.0
    assert all(seen.get(f"{MODEL}-0") in OUT for at, seen in load.states if at > out)
    retried = gw.sample("gpufleet:gateway_retries_total", model=MODEL, outcome="connect_failure")
    assert retried >= 1
    assert gw.sample("gpufleet:gateway_requests_total", model=MODEL, status="200") == len(
        load.results
    )


def test_a_hung_replica_times_out_on_first_byte_and_requests_move_on() -> None:
    config = fleet(
        routing="round_robin", health=HEALTH, gateway={"timeouts": {"first_byte": FIRST_BYTE}}
    )
    with (
        admin_replica(seed=0) as hung,
        admin_replica(seed=1) as a,
        admin_replica(seed=2) as b,
        serve_gateway(config, [hung, a, b]) as gw,
    ):
        hang_at = 0.5
        load = run_load(gw, 3.0, [(hang_at, lambda: set_faults(hung, hang=True))])
        set_faults(hung, hang=False)
    assert_all_served(load)
    assert gw.sample("gpufleet:gateway_retries_total", model=MODEL, outcome="timeout") >= 1
    assert load.first_time(f"{MODEL}-0", OUT, after=hang_at) - hang_at < 2.5
    retried = [took for _, _, took in load.results if took > FIRST_BYTE]
    assert retried, "no request waited for the hung replica"


def test_a_slow_replica_gets_less_traffic() -> None:
    # slower model time, so that a request takes long enough to be seen in flight
    config = fleet(
        routing="kv_aware",
        health=HEALTH,
        gateway={"timeouts": {"first_byte": 5.0}, "scrape_interval": 0.1},
    )
    with (
        admin_replica(time_scale=4.0, seed=0) as slow,
        admin_replica(time_scale=4.0, seed=1) as a,
        admin_replica(time_scale=4.0, seed=2) as b,
        serve_gateway(config, [slow, a, b]) as gw,
    ):
        set_faults(slow, slowdown=10.0)
        load = run_load(gw, 3.0, [], max_tokens=24)
        slow_share = served(gw, f"{MODEL}-0") / len(load.results)
    assert_all_served(load, bound=5.0)
    assert slow_share < 0.2, f"the slow replica served {slow_share:.0%}"
    # not ejected: slow is not failing
    assert all(seen.get(f"{MODEL}-0") is ReplicaState.READY for _, seen in load.states[5:])


def test_a_replica_answering_500s_is_ejected_then_readmitted() -> None:
    config = fleet(
        routing="round_robin", health=HEALTH, gateway={"timeouts": {"first_byte": FIRST_BYTE}}
    )
    replica = f"{MODEL}-0"
    with (
        admin_replica(seed=0) as flaky,
        admin_replica(seed=1) as a,
        admin_replica(seed=2) as b,
        serve_gateway(config, [flaky, a, b]) as gw,
    ):
        before = threading.Event()
        marks: dict[str, float] = {}

        def recover() -> None:
            marks["served"] = served(gw, replica)
            set_faults(flaky, error_rate=0.0)
            before.set()

        errors_at, recover_at = 0.5, 1.0
        load = run_load(
            gw,
            4.0,
            [(errors_at, lambda: set_faults(flaky, error_rate=1.0)), (recover_at, recover)],
        )
        after = served(gw, replica)
    assert_all_served(load)
    ejected = load.first_time(replica, frozenset({ReplicaState.EJECTED}), after=errors_at)
    assert ejected - errors_at < 1.0
    assert (
        gw.sample(
            "gpufleet:gateway_ejections_total",
            model=MODEL,
            cause="consecutive_5xx",
            enforced="true",
        )
        == 1
    )
    back = load.first_time(replica, IN, after=ejected)
    # out for the base ejection time (1 s), then a recovery probe (every 0.2 s) readmits it
    assert 0.9 <= back - ejected < 2.0
    assert before.is_set()
    assert after - marks["served"] >= 5
