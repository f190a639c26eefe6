"""One rule for served names: the gateway's adapter and the simulator's, fed one scripted
world with a weighted split, sticky sessions and fallbacks, make the same decisions.

The machinery is ``test_one_rule``'s (no I/O: ``LiveControl`` on an asyncio loop with a test
clock, ``SimControl`` on the real kernel with a stand-in harness), over three pools: ``chat``
is served by ``v1`` and ``v2`` (80/20) and falls back to ``big``, the one pool whose context
holds a long prompt. The script crashes ``v2``'s only replica under two requests (one
retried, then falling back; one mid-stream, broken) and fills ``v1``'s admission queue until
it sheds (the shed requests fall back). Both logs must agree line by line, events and
commands (a replica's incarnation aside).
"""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.control import FleetController, Route
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState, RouteRequest
from gpufleet.gateway import GatewayMetrics
from gpufleet.gateway._control import LiveControl
from gpufleet.gateway._replicas import Upstream
from gpufleet.sim import SimControl, TraceRequest, token_prefix_hashes
from gpufleet.sim._kernel import Kernel
from tests.control.test_one_rule import (
    OUTPUT,
    Down,
    End,
    Lost,
    Scrape,
    ScriptedHarness,
    ScriptedReplicas,
    Up,
    _compare,
    _Driver,
    _kinds,
    _lines,
    _without_incarnations,
)

POOLS = {"v1": 2, "v2": 1, "big": 2}
"""Pools and their replicas, in the fleet file's order (the simulator's driver order)."""
REPLICAS = [(pool, j) for pool, n in POOLS.items() for j in range(n)]
"""Global replica index → (pool, index in pool)."""
SERVED = "chat"


def fleet() -> FleetConfig:
    small = {"max_model_len": 2048, "args": ["--max-num-seqs", "2"]}
    return parse_fleet(
        {
            "models": [
                {"name": "v1", "model": "llama-3.1-8b", "replicas": 2, **small},
                {"name": "v2", "model": "llama-3.1-8b", "replicas": 1, **small},
                {"name": "big", "model": "llama-3.1-8b", "replicas": 2},
            ],
            "served": [{"name": SERVED, "variants": {"v1": 80, "v2": 20}, "fallbacks": ["big"]}],
            "tenants": {"admission": {"max_queue": 2, "max_wait": 3.0}},
            # a request at a pool whose replica restarts falls back at once (no hold)
            "gateway": {"autoscaler": {"hold_requests": 0}},
        }
    )


# -- the script ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrive:
    i: int
    session: str
    long: bool = False


Step = Arrive | End | Lost | Down | Up | Scrape

# sessions by the variant the controller gives them (choose_variant, 80/20): fixed by the hash
V1 = ["session-0", "session-1", "session-2", "session-4", "session-5", "session-8"]
V2 = ["session-3", "session-6"]


def prompt(i: int, long: bool) -> tuple[int, ...]:
    return tuple(range(i * 10_000, i * 10_000 + (3000 if long else 300 + 10 * i)))


SCRIPT: list[tuple[float, Step]] = [  # in time order
    (0.5, Scrape(dict.fromkeys(range(len(REPLICAS)), (0, 0, 0.0)))),
    (1.00, Arrive(0, V2[0])),  # v2
    (1.01, Arrive(1, V2[1])),  # v2
    (1.02, Arrive(2, V1[0], long=True)),  # no variant of chat holds 3,000 tokens: big
    *[(1.03 + 0.01 * n, Arrive(3 + n, V1[n % len(V1)])) for n in range(8)],  # v1: 4 run
    (1.2, Scrape({0: (2, 0, 0.2), 1: (2, 0, 0.2), 2: (2, 0, 0.2), 3: (1, 0, 0.1), 4: (0, 0, 0.0)})),
    *[(1.3 + 0.01 * n, Arrive(11 + n, V1[n % len(V1)])) for n in range(3)],  # queue, then shed
    (1.5, Lost(0)),  # v2's replica crashes: no other replica there, so it falls back to big
    (1.5, Lost(1, started=True)),  # mid-stream: not resumable elsewhere in v2, broken
    (1.5, Down(2)),
    (1.6, Arrive(14, V2[0])),  # v2 has no replica now (no hold): big
    *[(2.0 + 0.05 * n, End(i)) for n, i in enumerate(range(2, 15))],
    (3.0, Up(2)),
    (3.5, Scrape(dict.fromkeys(range(len(REPLICAS)), (0, 0, 0.0)))),
    (4.0, Arrive(15, V2[0])),  # back on v2: sticky
    (4.1, End(15)),
    (6.0, Arrive(16, V1[1])),
    (6.1, End(16)),
]
HORIZON = 12.0
assert [t for t, _ in SCRIPT] == sorted(t for t, _ in SCRIPT)


def rid_of(k: int) -> ReplicaId:
    pool, j = REPLICAS[k]
    return ReplicaId(f"{pool}-{j}")


# -- the gateway's adapter ------------------------------------------------------------------------


@dataclass
class LiveWorld:
    now: float = 0.0
    restarts: list[int] = field(default_factory=lambda: [0] * len(REPLICAS))
    down: set[int] = field(default_factory=set)

    def url(self, k: int) -> str:
        return f"http://10.0.0.{k}:{8000 + self.restarts[k]}"

    def upstreams(self) -> list[Upstream]:
        return [
            Upstream(
                rid_of(k),
                REPLICAS[k][0],
                None if k in self.down else self.url(k),
                ReplicaState.STARTING if k in self.down else ReplicaState.READY,
            )
            for k in range(len(REPLICAS))
        ]


async def run_live(config: FleetConfig) -> list[dict[str, Any]]:
    world = LiveWorld()
    live = LiveControl(
        config, GatewayMetrics(CollectorRegistry()), clock=lambda: world.now, admission=True
    )
    log = io.StringIO()
    live.record(log)
    decisions: dict[int, asyncio.Task[Any]] = {}
    ended: set[int] = set()

    def up(url: str) -> bool:
        return any(url == world.url(k) and k not in world.down for k in range(len(REPLICAS)))

    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def until(t: float) -> None:
        for _ in range(10_000):
            if (at := live.wake_at) >= t:
                world.now = t
                return
            world.now = max(at, world.now)
            live.tick()
            await settle()
        raise AssertionError(f"the timer is stuck at {live.wake_at}")

    def on_replica(i: int) -> Route | None:
        task = decisions.get(i)
        if task is None or not task.done() or i in ended:
            return None
        decision = task.result()
        return decision if isinstance(decision, Route) else None

    def scrape(loads: dict[int, tuple[int, int, float]]) -> None:
        for pool in POOLS:  # every scraped pool gets its round, in the file's order
            rows = {
                rid_of(k): load
                for k, load in loads.items()
                if REPLICAS[k][0] == pool and k not in world.down
            }
            live.scraped(pool, rows)

    async with asyncio.TaskGroup() as tasks:
        live.start(tasks, ScriptedReplicas(up))
        live.set_replicas(world.upstreams())
        await settle()
        for t, step in SCRIPT:
            await until(t)
            match step:
                case Arrive(i=i, session=session, long=long):
                    p = prompt(i, long)
                    request = RouteRequest(
                        str(i), SERVED, token_prefix_hashes(p), len(p), session, None, OUTPUT
                    )
                    decisions[i] = tasks.create_task(live.arrive(request, resumable=True))
                case End(i=i) if (route := on_replica(i)) is not None:
                    ended.add(i)
                    # as the gateway does: the pool the Route named
                    live.finished(route.model or SERVED, str(i), Outcome.SUCCESS)
                case Lost(i=i, started=started) if (route := on_replica(i)) is not None:
                    failed = live.failed(
                        route.model or SERVED, str(i), Outcome.CONNECT_FAILURE, streamed=started
                    )
                    decisions[i] = tasks.create_task(failed)
                case Down(replica=k):
                    world.down.add(k)
                    live.set_replicas(world.upstreams())
                case Up(replica=k):
                    world.down.discard(k)
                    world.restarts[k] += 1
                    live.set_replicas(world.upstreams())
                case Scrape(loads=loads):
                    scrape(loads)
            await settle()
        await until(HORIZON)
        live.stop()
        for task in decisions.values():
            task.cancel()
    return _lines(log)


# -- the simulator's adapter ----------------------------------------------------------------------


def run_sim(config: FleetConfig) -> list[dict[str, Any]]:
    kernel = Kernel()
    control = FleetController.of(config, admission=True, autoscale=False)
    log = io.StringIO()
    control.record(log)
    sim = SimControl(control, list(POOLS.values()), scrape_interval=1.0)
    harness = ScriptedHarness(kernel)
    harness.drivers = [_Driver() for _ in REPLICAS]
    sim.attach(harness)  # type: ignore[arg-type]  # the stand-in harness
    ended: set[int] = set()

    def driver_of(i: int) -> int | None:
        commands = [c for line in _lines(log) for c in line["commands"] if c.get("id") == str(i)]
        routes = [c for c in commands if c["do"] in ("route", "reject")][-1:]
        if i in ended or not routes or routes[0]["do"] != "route":
            return None
        return sim.replicas.by_id[ReplicaId(routes[0]["replica"])].driver

    for t, step in SCRIPT:
        kernel.run(until=t)
        events: list[Any] = []
        match step:
            case Arrive(i=i, session=session, long=long):
                p = prompt(i, long)
                trace = TraceRequest(t, len(p), OUTPUT, session=session, model=SERVED)
                events = sim.arrive(t, i, trace, p)
            case End(i=i) if (k := driver_of(i)) is not None:
                ended.add(i)
                sim.on_end(t, i, k, rejected=False)
            case Lost(i=i, started=started) if (k := driver_of(i)) is not None:
                events = sim.on_lost(t, i, k, started)
            case Down(replica=k):
                harness.drivers[k].down = True
                sim.replica_down(t, k)
            case Up(replica=k):
                harness.drivers[k].down = False
                sim.replica_up(t, k)
            case Scrape(loads=loads):
                for k, driver in enumerate(harness.drivers):
                    driver.scraped = loads.get(k)
                sim.blackout = {k for k in range(len(REPLICAS)) if k not in loads}
                sim.scrape(t)
        for event in events:
            kernel.schedule(event.time, event.priority, event.event)
    kernel.run(until=HORIZON)
    return _lines(log)


# -- the comparison -------------------------------------------------------------------------------


def _compare_from_start(live: list[dict[str, Any]], sim: list[dict[str, Any]]) -> None:
    """At the start (t = 0) the gateway hands over every pool's list first and its probe
    tasks answer after; the simulator answers each pool's probes at once. Pools are
    independent, so those lines are compared as a set; every line after, one by one."""
    start = [json.dumps(_without_incarnations(x), sort_keys=True) for x in live if x["t"] == 0]
    same = [json.dumps(_without_incarnations(x), sort_keys=True) for x in sim if x["t"] == 0]
    assert sorted(start) == sorted(same)
    assert len(start) >= 2 * len(POOLS)  # each pool's list and its replicas' first probes
    _compare(live[len(start) :], sim[len(same) :])


def test_both_adapters_make_the_same_variant_and_fallback_decisions() -> None:
    config = fleet()
    live = asyncio.run(run_live(config))
    sim = run_sim(config)
    _compare_from_start(live, sim)
    commands = [c for line in live for c in line["commands"]]
    fallbacks = [c for c in commands if c["do"] == "fallback"]
    reasons = {c["reason"] for c in fallbacks}
    # the script reached every rule it means to compare
    assert {"context", "exhausted", "shed", "no_replica"} <= reasons, fallbacks
    assert all(c["to"] == "big" and c["pool"] == "big" for c in fallbacks)
    kinds = _kinds(live)
    assert kinds.get("reject:broken") == 1, kinds  # the stream cut in v2: final
    # every route of chat names its pool; sessions stay on their variant
    first: dict[str, str] = {}
    arrivals = {
        line["event"]["id"]: line["event"]["session"]
        for line in live
        if line["event"]["kind"] == "arrived"
    }
    for command in commands:
        if command["do"] == "route" and not command["retry"]:
            assert command["model"] == command["replica"].rsplit("-", 1)[0]
    for line in live:
        if line["event"]["kind"] != "arrived":
            continue
        for command in line["commands"]:
            if command["do"] == "route":
                session = arrivals[command["id"]]
                if command["model"] != "big":
                    assert first.setdefault(session, command["model"]) == command["model"]
    assert first[V2[0]] == "v2"  # back on v2 once its replica is back
    assert {first[s] for s in V1 if s in first} == {"v1"}
    ends = [line for line in live if line["event"]["kind"] == "finished"]
    assert {line["event"]["model"] for line in ends} <= set(POOLS)  # pools, not the name
