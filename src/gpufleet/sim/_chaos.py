"""The chaos run: one random fault schedule per seed, through the whole control loop, and the
invariants that must hold whatever the schedule.

``chaos_run(seed)`` draws a small fleet (2–4 replicas, a routing policy, admission on or
off, tight or loose health and retry settings), a tenant mix, a burst of requests and a
schedule of crashes, slow replicas, metric blackouts, replicas that answer 5xx and hung
replicas, all from ``Random(seed)``; it runs the simulator (the real pool controller and
policies) and checks, on the finished run:

* **every request ends exactly once**, in a response or an error (``FleetSimulation.check``);
* **none waits past its deadline**: the time before its first attempt is at most the
  admission queue's ``max_wait`` plus the empty-pool hold's ``hold_timeout`` (and, for a
  batch line, the spare-capacity gate's ``max_wait`` before them);
* **no replica is routed to while ejected**: no ``Route`` (outside panic routing, which
  routes to every replica on purpose) names a replica inside an enforced ejection's window
  (``at`` … ``at + duration``; a restart, with fresh health, ends the window);
* **no quota or ledger count is off**: per tenant, requests = served + rejected + failed and
  the report's output tokens are the records'; once every request has ended, every count of
  work in flight is zero again (the pool's requests, attempts and budgeted retries, the
  admission queue's running and queued tickets, per tenant too): nothing leaked a slot.

A violation is a sentence naming the seed's scenario, so ``bench/chaos.py --seed N`` replays it.
Deterministic: the same seed gives the same run and the same sentences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Any

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.control import BATCH, Arrived, Command, Ejected, FleetController, Replicas, Route
from gpufleet.control import Event as ControlEvent
from gpufleet.fleet import ReplicaId
from gpufleet.sim._admission import SimTenant
from gpufleet.sim._faults import (
    BlackoutFault,
    CrashFault,
    ErrorFault,
    Fault,
    HangFault,
    SlowFault,
)
from gpufleet.sim._simulate import FleetSimulation, SimOptions
from gpufleet.sim._traces import TraceRequest

MODEL = "llama-3.1-8b"
_POLICIES = ("round_robin", "least_request", "kv_aware", "prefix_aware")
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class ChaosScenario:
    """What one seed draws: the fleet file, the faults, the tenants and the requests."""

    seed: int
    fleet: dict[str, Any]
    faults: tuple[Fault, ...]
    tenants: tuple[SimTenant, ...]
    requests: tuple[TraceRequest, ...]

    def describe(self) -> str:
        model = self.fleet["models"][0]
        admission = self.fleet.get("tenants", {}).get("auth", False)
        kinds = [type(f).__name__.removesuffix("Fault").lower() for f in self.faults]
        return (
            f"seed {self.seed}: {model['replicas']} replicas, {model['routing']['policy']}, "
            f"admission {'on' if admission else 'off'}, {len(self.requests)} requests, "
            f"faults: {', '.join(kinds) or 'none'}"
        )


@dataclass(slots=True)
class ChaosResult:
    """One seed's run: what happened, and the invariants it broke (none: an empty list)."""

    scenario: ChaosScenario
    problems: list[str]
    requests: int
    failed: int
    rejected: int
    crashes: int
    ejections: int
    routes: int
    resumed: int
    simulated_s: float

    @property
    def ok(self) -> bool:
        return not self.problems


def chaos_scenario(seed: int, *, requests: int = 200) -> ChaosScenario:
    """The scenario seed ``seed`` draws (``requests``: how many arrive)."""
    rng = Random(seed)
    replicas = rng.choice((2, 3, 3, 4))
    seqs = rng.choice((4, 8, 16, 64))
    admission = rng.random() < 0.6
    model: dict[str, Any] = {
        "name": MODEL,
        "replicas": replicas,
        "routing": {"policy": rng.choice(_POLICIES)},
        "args": [f"--max-num-seqs={seqs}"],
        "health": {
            "outlier": {
                "consecutive_5xx": rng.choice((1, 2, 5)),
                "consecutive_local_origin_failure": rng.choice((1, 2, 5)),
                "base_ejection_time": rng.choice((1.0, 5.0, 30.0)),
                "max_ejection_percent": rng.choice((34.0, 50.0, 100.0)),
            },
            "active": {"interval": rng.choice((0.5, 1.0, 5.0)), "timeout": 0.5},
        },
    }
    retry = {"max_retries": rng.choice((0, 1, 2)), "max_resumes": rng.choice((0, 1, 2))}
    fleet: dict[str, Any] = {"models": [model], "gateway": {"retry": retry}}
    if admission:
        fleet["tenants"] = {
            "auth": True,
            "admission": {
                "max_wait": rng.choice((0.5, 2.0, 10.0)),
                "max_queue": rng.choice((4, 32, 1024)),
                "saturation": rng.choice((0.5, 1.0)),
            },
        }
    tenants = tuple(
        SimTenant(
            f"t{i}",
            share=rng.choice((1.0, 3.0)),
            weight=rng.choice((1.0, 2.0)),
            priority=rng.choice(("interactive", "interactive", "batch")),
        )
        for i in range(rng.choice((1, 2, 3)))
    )
    # Poisson arrivals at 0.5–2× what the fleet can take (about 6 req/s a replica here)
    rate = replicas * rng.uniform(3.0, 12.0)
    prefixes = [tuple(rng.randrange(1 << 30) for _ in range(rng.randrange(1, 6))) for _ in range(4)]
    trace: list[TraceRequest] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        prompt = rng.randrange(16, 3000)
        shared = rng.choice(prefixes) if rng.random() < 0.5 else None
        hashes = None
        if shared is not None:
            blocks = max(1, prompt // 512)
            hashes = (shared + tuple(rng.randrange(1 << 30) for _ in range(blocks)))[:blocks]
            prompt = max(prompt, 512 * len(hashes))
        trace.append(TraceRequest(t, prompt, rng.randrange(1, 400), hash_ids=hashes))
    end = t
    faults: list[Fault] = []
    names = [f"{MODEL}-{i}" for i in range(replicas)]
    for _ in range(rng.choice((0, 1, 2, 3))):
        faults.append(
            CrashFault(
                replica=rng.choice(names),
                at=round(rng.uniform(0.0, end), 3),
                startup_s=rng.choice((0.5, 3.0, 15.0)),
            )
        )
    for _ in range(rng.choice((0, 1, 2))):
        start = rng.uniform(0.0, end)
        faults.append(
            SlowFault.model_validate(
                {
                    "replica": rng.choice(names),
                    "factor": rng.choice((2.0, 5.0, 20.0)),
                    "from": round(start, 3),
                    "to": round(start + rng.uniform(0.5, 10.0), 3),
                }
            )
        )
    windows: tuple[tuple[type[Fault], tuple[int, ...], float], ...] = (
        (BlackoutFault, (0, 1), 10.0),
        (ErrorFault, (0, 1, 1, 2), 20.0),
        (HangFault, (0, 0, 1), 15.0),
    )  # (kind, how many of it to draw from, its longest window in s)
    for kind, counts, longest in windows:
        for _ in range(rng.choice(counts)):
            start = rng.uniform(0.0, end)
            replica = rng.choice(names)
            length = rng.uniform(0.5, longest)
            window = {"replica": replica, "from": round(start, 3), "to": round(start + length, 3)}
            faults.append(kind.model_validate(window))
    return ChaosScenario(seed, fleet, tuple(faults), tenants, tuple(trace))


@dataclass(slots=True)
class _Window:
    at: float
    until: float


@dataclass(slots=True)
class _Watch:
    """What the controller said and heard, as the invariants need it (sees, never changes)."""

    windows: dict[ReplicaId, list[_Window]] = field(default_factory=dict)
    incarnations: dict[ReplicaId, str | None] = field(default_factory=dict)
    routes: int = 0
    problems: list[str] = field(default_factory=list)
    batch: set[int] = field(default_factory=set)
    """Requests of the batch class (they may wait at the spare-capacity gate first)."""

    def event(self, now: float, event: ControlEvent) -> None:
        if isinstance(event, Arrived):
            if event.priority == BATCH:
                self.batch.add(int(event.request.request_id))
        elif isinstance(event, Replicas):
            for seen in event.replicas:
                before = self.incarnations.get(seen.id, seen.incarnation)
                if seen.incarnation != before:  # a new process: its health starts afresh
                    for window in self.windows.get(seen.id, ()):
                        window.until = min(window.until, now)
                self.incarnations[seen.id] = seen.incarnation

    def commands(self, now: float, commands: Sequence[Command]) -> None:
        for command in commands:
            if isinstance(command, Ejected):
                record = command.record
                if record.enforced:
                    window = _Window(record.at, record.at + record.duration)
                    self.windows.setdefault(record.replica, []).append(window)
            elif isinstance(command, Route):
                self.routes += 1
                if command.panic:
                    continue
                for window in self.windows.get(command.replica, ()):
                    if window.at <= now < window.until - _EPSILON:
                        self.problems.append(
                            f"request {command.request_id} routed to {command.replica} at "
                            f"{now:.3f} s, ejected from {window.at:.3f} to {window.until:.3f} s"
                        )


class _Watched:
    """The controller, seen through a :class:`_Watch`: every ``handle`` passes through."""

    def __init__(self, control: FleetController, watch: _Watch) -> None:
        self._control = control
        self._watch = watch

    def handle(self, now: float, event: ControlEvent) -> list[Command]:
        self._watch.event(now, event)
        commands = self._control.handle(now, event)
        self._watch.commands(now, commands)
        return commands

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)


def chaos_run(
    seed: int,
    *,
    requests: int = 200,
    tamper: Callable[[FleetSimulation], None] | None = None,
) -> ChaosResult:
    """Run seed ``seed``'s scenario and check the invariants (``tamper``: for tests that
    prove a check can fail, a change made to the simulation before it runs)."""
    scenario = chaos_scenario(seed, requests=requests)
    config: FleetConfig = parse_fleet(scenario.fleet, source=f"chaos seed {seed}")
    sim = FleetSimulation(
        config, SimOptions(seed=seed, faults=scenario.faults, tenants=scenario.tenants)
    )
    watch = _Watch()
    sim.routing.control = _Watched(sim.control, watch)  # type: ignore[assignment]
    if tamper is not None:
        tamper(sim)
    sim.start(scenario.requests)
    sim.run()
    report = sim.report({})
    problems = [
        *sim.check(),
        *watch.problems,
        *_waits(sim, watch.batch),
        *_ledger(sim, report),
        *_leaks(sim),
        *_causes(report),
    ]
    overall, faults = report["overall"], report.get("faults") or {}
    return ChaosResult(
        scenario=scenario,
        problems=[f"{scenario.describe()}: {p}" for p in problems[:20]],
        requests=overall["requests"],
        failed=overall["failed"],
        rejected=overall["rejected"],
        crashes=faults.get("crashes", 0),
        ejections=len(sim.routing.ejections),
        routes=watch.routes,
        resumed=faults.get("resumed_streams", 0),
        simulated_s=report["simulated_s"],
    )


def _waits(sim: FleetSimulation, batch: set[int]) -> Iterator[str]:
    settings = sim.control.pools[MODEL].settings
    limit = settings.hold_timeout
    if settings.admission is not None:
        limit += settings.admission.max_wait
    gate = 0.0 if settings.spare is None else settings.spare.max_wait
    for index, waited in sim.routing.waits.items():
        bound = limit + gate if index in batch else limit  # a batch line may wait at the gate
        if waited > bound + _EPSILON:
            yield f"request {index} waited {waited:.3f} s before its first attempt (> {bound} s)"


def _ledger(sim: FleetSimulation, report: dict[str, Any]) -> Iterator[str]:
    book = sim.tenants
    if book is None:
        return
    names = book.tenants()
    counted: dict[str, list[int]] = {name: [0, 0] for name in names}
    for record in sim.harness.recorder.log:
        row = counted[names[book.tenant_ids[record.index]]]
        row[0] += 1
        if not (record.rejected or record.failed):
            row[1] += record.output_tokens
    tenants = report["tenants"]["tenants"]
    for name, (ended, output) in counted.items():
        shown = tenants[name]
        if shown["requests"] != shown["served"] + shown["rejected"] + shown["failed"]:
            yield f"tenant {name}: requests {shown['requests']} != served + rejected + failed"
        if shown["requests"] != ended:
            yield f"tenant {name}: {shown['requests']} requests reported, {ended} ended"
        if shown["output_tokens"] != output:
            yield f"tenant {name}: {shown['output_tokens']} output tokens reported, {output} served"


_CAUSES = ("no_replica", "lost_mid_stream", "retries_refused", "hold_timeouts")


def _causes(report: dict[str, Any]) -> Iterator[str]:
    """Every failed request failed for a reason the report names: shed or expired by the
    admission queue, no replica to take it, a stream lost past its resumes, a retry the
    budget refused, a hold that timed out. A failure with no cause is a lost request."""
    failed = report["overall"]["failed"]
    faults = report.get("faults") or {}
    causes = {cause: faults.get(cause, 0) for cause in _CAUSES}
    for tenant in (report.get("tenants") or {}).get("tenants", {}).values():
        causes["shed"] = causes.get("shed", 0) + tenant["shed"]
        causes["expired"] = causes.get("expired", 0) + tenant["expired"]
    if failed != sum(causes.values()):
        named = ", ".join(f"{k} {v}" for k, v in causes.items() if v) or "none"
        yield f"{failed} requests failed, but the causes count {sum(causes.values())} ({named})"


def _leaks(sim: FleetSimulation) -> Iterator[str]:
    """Every count of work in flight is back to zero once every request has ended."""
    for model, pool in sim.control.pools.items():
        attempts = sum(pool.attempts.values())
        for name, value in (
            ("requests in flight", pool.in_flight),
            ("retries in flight", pool.active_retries),
            ("attempts in flight", attempts),
        ):
            if value:
                yield f"pool {model}: {value} {name} after the run"
        admission = pool.admission
        if admission is None:
            continue
        queue = admission.queue
        if admission.in_flight or len(queue):
            yield (
                f"pool {model}: admission holds {admission.in_flight} running and "
                f"{len(queue)} queued after the run"
            )
        for tenant, running in queue.running.items():
            if running:
                yield f"pool {model}: tenant {tenant} still has {running} running in the queue"
