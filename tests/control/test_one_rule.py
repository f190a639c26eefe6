"""One rule, not two: the gateway's adapter and the simulator's, fed the same scripted world,
hand their controllers the same events and get the same commands back.

Neither side does I/O here. The gateway's adapter (``LiveControl``) runs on an asyncio loop
with a test clock; its probes go to a stand-in replica client that answers from the script.
The simulator's adapter (``SimControl``) runs on the real event kernel with a stand-in
harness in place of the modelled replicas (the script says when each request ends). Both
record every event and command (``--record``'s log); the two logs must agree line by line.
The only difference allowed is a replica's incarnation: the gateway names a process by its
address, the simulator by its restart count.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable, Sequence
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

POOL = "llama-3.1-8b"
REPLICAS = 3
SYSTEM = tuple(range(1000, 1512))  # a 512-token system prompt every request shares
OUTPUT = 16  # the output tokens each request asks for (the gateway reads `max_tokens`)


def fleet(routing: str) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": REPLICAS,
                    "routing": routing,
                    "args": ["--max-num-seqs", "2"],
                }
            ],
            "tenants": {"admission": {"max_queue": 6, "max_wait": 4.0}},
        }
    )


# -- the script: what happens in the world, in neither shell's words --------------------------


@dataclass(frozen=True)
class Arrive:
    i: int
    tenant: str
    priority: int = 0


@dataclass(frozen=True)
class End:
    """Request ``i``'s attempt answers (on whichever replica it was sent to)."""

    i: int


@dataclass(frozen=True)
class Lost:
    """Request ``i``'s attempt fails: its replica crashed (``started``: after a byte)."""

    i: int
    started: bool = False


@dataclass(frozen=True)
class Down:
    replica: int


@dataclass(frozen=True)
class Up:
    replica: int


@dataclass(frozen=True)
class Scrape:
    loads: dict[int, tuple[int, int, float]]


Step = Arrive | End | Lost | Down | Up | Scrape


def prompt(i: int) -> tuple[int, ...]:
    return SYSTEM + tuple(range(i * 1000, i * 1000 + 256 + 64 * (i % 3)))


SCRIPT: list[tuple[float, Step]] = [
    (0.5, Scrape({0: (0, 0, 0.0), 1: (1, 0, 0.05), 2: (0, 0, 0.0)})),
    *[(1.0 + 0.01 * i, Arrive(i, "a" if i % 3 else "b", priority=i % 2)) for i in range(9)],
    (1.2, End(0)),
    # the replica the shared prefix drew them to crashes under four of them
    (1.3, Lost(1)),  # retried elsewhere
    (1.3, Lost(2, started=True)),  # streaming when it broke: resumed elsewhere
    (1.3, Lost(3)),
    (1.3, Lost(4)),
    (1.3, Down(2)),
    (1.4, Scrape({0: (2, 0, 0.3), 1: (3, 1, 0.4)})),
    *[(1.5 + 0.01 * i, Arrive(i, "c")) for i in range(9, 14)],  # queued: the pool is full
    *[(2.0 + 0.1 * k, End(i)) for k, i in enumerate(range(3, 9))],
    (3.5, Up(2)),
    (4.0, End(1)),
    *[(4.5 + 0.1 * k, End(i)) for k, i in enumerate(range(9, 14))],
    (9.0, Arrive(14, "a")),
    (9.5, End(14)),
]
HORIZON = 12.0


# -- the gateway's adapter ----------------------------------------------------------------------


class ScriptedReplicas:
    """The replica client's probes, answered from the script (no sockets): a replica is
    healthy while it is up."""

    def __init__(self, up: Callable[[str], bool]) -> None:
        self._up = up

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        assert url.endswith("/health"), url
        return (200 if self._up(url.removesuffix("/health")) else 503), b""

    def send(self, request: Any) -> Any:
        raise AssertionError("the adapter only probes")


@dataclass
class LiveWorld:
    config: FleetConfig
    now: float = 0.0
    restarts: list[int] = field(default_factory=lambda: [0] * REPLICAS)
    down: set[int] = field(default_factory=set)

    def url(self, k: int) -> str:
        return f"http://10.0.0.{k}:{8000 + self.restarts[k]}"

    def upstreams(self) -> list[Upstream]:
        return [
            Upstream(
                ReplicaId(f"{POOL}-{k}"),
                POOL,
                None if k in self.down else self.url(k),
                ReplicaState.STARTING if k in self.down else ReplicaState.READY,
            )
            for k in range(REPLICAS)
        ]


async def run_live(config: FleetConfig) -> list[dict[str, Any]]:
    world = LiveWorld(config)
    live = LiveControl(
        config,
        GatewayMetrics(CollectorRegistry()),
        clock=lambda: world.now,
        admission=True,
    )
    log = io.StringIO()
    live.record(log)
    decisions: dict[int, asyncio.Task[Any]] = {}
    ended: set[int] = set()

    def up(url: str) -> bool:
        return any(url == world.url(k) and k not in world.down for k in range(REPLICAS))

    async def settle() -> None:
        for _ in range(5):  # probe tasks and woken waiters run
            await asyncio.sleep(0)

    async def until(t: float) -> None:
        """Let the controller's timer fire for everything due before ``t``."""
        for _ in range(10_000):  # a timer that never moves on fails, not hangs
            if (at := live.wake_at) >= t:
                world.now = t
                return
            world.now = max(at, world.now)
            live.tick()
            await settle()
        raise AssertionError(f"the timer is stuck at {live.wake_at}")

    def in_attempt(i: int) -> bool:
        """Request ``i`` is on a replica now (the script's ends skip the others)."""
        return decisions[i].done() and isinstance(decisions[i].result(), Route) and i not in ended

    async with asyncio.TaskGroup() as tasks:
        live.start(tasks, ScriptedReplicas(up))
        live.set_replicas(world.upstreams())
        await settle()
        for t, step in SCRIPT:
            await until(t)
            match step:
                case Arrive(i=i, tenant=tenant, priority=priority):
                    p = prompt(i)
                    request = RouteRequest(
                        str(i), POOL, token_prefix_hashes(p), len(p), None, tenant, OUTPUT
                    )
                    # every simulated request is resumable; the gateway says which are
                    arrival = live.arrive(request, priority, resumable=True)
                    decisions[i] = tasks.create_task(arrival)
                case End(i=i) if in_attempt(i):
                    ended.add(i)
                    live.finished(POOL, str(i), Outcome.SUCCESS)
                case Lost(i=i, started=started) if in_attempt(i):
                    decision = live.failed(POOL, str(i), Outcome.CONNECT_FAILURE, streamed=started)
                    decisions[i] = tasks.create_task(decision)
                case Down(replica=k):
                    world.down.add(k)
                    live.set_replicas(world.upstreams())
                case Up(replica=k):
                    world.down.discard(k)
                    world.restarts[k] += 1
                    live.set_replicas(world.upstreams())
                case Scrape(loads=loads):
                    live.scraped(
                        POOL, {ReplicaId(f"{POOL}-{k}"): load for k, load in loads.items()}
                    )
            await settle()
        await until(HORIZON)
        live.stop()
        for task in decisions.values():  # one still waiting would hold the task group open
            task.cancel()
    return _lines(log)


# -- the simulator's adapter ---------------------------------------------------------------------


class ScriptedHarness:
    """Stands in for the modelled replicas (``FleetHarness``): the controller's commands
    are noted, and requests end when the script says. The kernel is the real one."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.active = True
        self.gate: object = None
        self.routing: object = None
        self.drivers: list[Any] = []
        self.recorder = type("Recorder", (), {"log": []})()

    def every(self, interval: float, callback: Callable[[float], None]) -> None:
        pass  # scrapes come from the script

    def submit_new(self, now: float, index: int, *_: object) -> list[Any]:
        return []

    def submit_retry(self, now: float, index: int, replica: int, priority: int = 0) -> list[Any]:
        return []

    def submit_resume(self, now: float, index: int, replica: int) -> list[Any]:
        return []

    def refuse(self, now: float, index: int, *_: object) -> None:
        pass

    def fail_lost(self, now: float, index: int) -> None:
        pass


@dataclass
class _Driver:
    down: bool = False
    scraped: tuple[int, int, float] | None = None

    def load(self) -> tuple[int, int, float]:
        """What a scrape reads (``ReplicaDriver.load``): running, waiting, KV usage."""
        assert self.scraped is not None
        return self.scraped


def run_sim(config: FleetConfig) -> list[dict[str, Any]]:
    kernel = Kernel()
    control = FleetController.of(config, admission=True, autoscale=False)
    log = io.StringIO()
    control.record(log)
    tenants: dict[int, tuple[str, int, float]] = {}
    sim = SimControl(
        control,
        [REPLICAS],
        scrape_interval=1.0,
        tenant_of=lambda i, _: tenants[i],
    )
    harness = ScriptedHarness(kernel)
    harness.drivers = [_Driver() for _ in range(REPLICAS)]
    sim.attach(harness)  # type: ignore[arg-type]  # the stand-in harness

    def driver_of(i: int) -> int | None:
        """The replica request ``i`` is on now (``None``: none; the script's ends skip it)."""
        last = [c for c in _commands(log) if c.get("id") == str(i)][-1:]
        if i in ended or not last or last[0]["do"] != "route":
            return None
        return sim.replicas.by_id[ReplicaId(last[0]["replica"])].driver

    ended: set[int] = set()

    for t, step in SCRIPT:
        kernel.run(until=t)
        match step:
            case Arrive(i=i, tenant=tenant, priority=priority):
                tenants[i] = (tenant, priority, 1.0)
                p = prompt(i)
                events = sim.arrive(t, i, TraceRequest(t, len(p), OUTPUT), p)
            case End(i=i) if (k := driver_of(i)) is not None:
                ended.add(i)
                sim.on_end(t, i, k, rejected=False)
                events = []
            case Lost(i=i, started=started) if (k := driver_of(i)) is not None:
                events = sim.on_lost(t, i, k, started)
            case Down(replica=k):
                harness.drivers[k].down = True
                sim.replica_down(t, k)
                events = []
            case Up(replica=k):
                harness.drivers[k].down = False
                sim.replica_up(t, k)
                events = []
            case Scrape(loads=loads):
                for k, load in enumerate(harness.drivers):
                    load.scraped = loads.get(k)
                sim.blackout = {k for k in range(REPLICAS) if k not in loads}
                sim.scrape(t)
                events = []
            case _:
                events = []
        for event in events:
            kernel.schedule(event.time, event.priority, event.event)
    kernel.run(until=HORIZON)
    return _lines(log)


# -- the comparison ------------------------------------------------------------------------------


def _lines(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.getvalue().splitlines()[1:]]


def _commands(log: io.StringIO) -> list[dict[str, Any]]:
    return [c for line in _lines(log) for c in line["commands"]]


def _without_incarnations(line: dict[str, Any]) -> dict[str, Any]:
    event = line["event"]
    if event["kind"] == "replicas":  # an address live, a restart count simulated
        event = {**event, "replicas": [[r, s, n is not None] for r, s, n in event["replicas"]]}
    return {**line, "event": event}


def _compare(live: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]]) -> None:
    for n, (a, b) in enumerate(zip(live, sim, strict=False)):
        assert _without_incarnations(a) == _without_incarnations(b), f"line {n}"
    assert len(live) == len(sim)


def _kinds(lines: Sequence[dict[str, Any]]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for line in lines:
        for command in line["commands"]:
            key = command["do"] + ("" if command["do"] != "reject" else ":" + command["reason"])
            kinds[key] = kinds.get(key, 0) + 1
    return kinds


def test_both_adapters_make_the_same_decisions_on_one_script() -> None:
    config = fleet("prefix_aware")
    live = asyncio.run(run_live(config))
    sim = run_sim(config)
    _compare(live, sim)
    kinds = _kinds(live)
    # the script reached every rule it means to compare
    retries = [c for line in live for c in line["commands"] if c.get("retry")]
    assert len(retries) == 3, retries  # three of the four lost attempts; one had streamed
    assert kinds["route"] >= 15, kinds
    resumes = [c for line in live for c in line["commands"] if c.get("resume")]
    assert len(resumes) == 1, resumes  # the one that had streamed
    assert "reject:broken" not in kinds, kinds
    assert kinds.get("reject:shed", 0) >= 1, kinds  # the queue overflowed
    assert kinds["probe"] >= 2 * REPLICAS, kinds  # first probes, the restarted process's, ...
    queued = [line for line in live if line["event"]["kind"] == "arrived" and not line["commands"]]
    assert len(queued) >= 3, "too few requests waited in the admission queue"
    pumped = [
        line
        for line in live
        if line["event"]["kind"] in ("finished", "tick")
        and any(c["do"] == "route" for c in line["commands"])
    ]
    assert pumped, "no queued request was started by a later event"
