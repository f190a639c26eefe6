"""Faults in the simulated fleet: crashes (at given times or by MTBF), slow replicas, blackouts.

A scenario is a list of faults, written in a ``faults:`` YAML file or as ``--fault`` flags::

    faults:                                   # --fault crash:replica=llama-3.1-8b-2,at=300
      - crash: {replica: llama-3.1-8b-2, at: 300, startup_s: 90}
      - slow: {replica: llama-3.1-8b-0, factor: 3, from: 100, to: 400}
      - blackout: {replica: llama-3.1-8b-1, from: 200, to: 260}
      - errors: {replica: llama-3.1-8b-2, from: 50, to: 120}   # answers 5xx, /health fine
      - hang: {replica: llama-3.1-8b-1, from: 400, to: 430}    # stops: answers nothing
      - mtbf: {hours: 2.0, startup_s: 120}   # every replica: exponential time to failure
      - spot: {per_gpu_hour: 0.05, notice_s: 60}  # `capacity: spot` pools: preemptions
      - spot_outage: {from: 3600, to: 7200}       # no spot GPUs to be had meanwhile

Faults live in the simulated replicas and network; the control logic (routers, health
policy, retries) is the real one and never hears of a fault except through what it
observes: failed attempts, probes, scrapes that stop moving::

    Crash @ t ─► driver.crash: its requests are lost ─► each: retried (no token yet) or error
              ─► health sees CONNECT_FAILURE outcomes (may eject) ─► runtime: STARTING
              ─► Restart @ t + startup_s ─► READY: checks start over, READY the first pass
    SlowStart / SlowEnd ─► model.set_slowdown(factor) / (1.0)
    BlackoutStart / End ─► the replica's scrapes stop / resume updating
    Errors on / off ─► each new attempt sent there fails at once with a 5xx (REPLICA_ERROR,
              before any byte: retried by the budget's rule); probes still pass, so only
              outlier detection (consecutive 5xx) takes it out: a gray failure
    Notice @ t ─► the controller hears ``Preempting(replica, t + notice_s)``: no new attempt
              there; its attempts are abandoned ``abandon_before`` ahead (resumed, retried)
              ─► Crash @ t + notice_s (the provider takes the GPUs; counted as a preemption)
              ─► the controller hears ``Reclaimed``: ``Replace(spot | on_demand)``, or a
                 wait for spot GPUs (``spot.fallback``) ─► Restart @ + startup_s (the new
                 node, billed at its capacity's price) ─► the next draw (none on demand)
    Spot outage on / off (``spot_outage``, or ``spot.unavailable_s`` after each reclaim)
              ─► the controller hears ``SpotMarket``: back on, the waiting replicas and the
                 on-demand stand-ins get spot nodes (a stand-in serves on until its own
                 starts, then moves: its on-demand node is billed until then)
    Hang on / off ─► the process stops (SIGSTOP, a wedged GPU): its step in flight stalls,
              probes and scrapes get no answer; health fails it, and the controller
              abandons its attempts (retried, or resumed, elsewhere: ``control.Abandon``);
              at the end it steps on from where it stopped, and checks bring it back

A replica with ``tp`` GPUs fails ``tp`` times as often as one GPU: ``mtbf.hours`` is per
GPU (6–12 months, 4,400–8,800 h, for data-centre GPUs; scale it down for short runs), and
so is ``spot.per_gpu_hour``, the rate at which the provider reclaims spot GPUs (docs/spot.md).
Every fault event is shared (it changes what routers see), so no replica has run past it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from gpufleet.config import Capacity
from gpufleet.control import Replace
from gpufleet.engine.model import ReplicaModel
from gpufleet.fleet import ReplicaState
from gpufleet.sim._autoscale import Autoscaling
from gpufleet.sim._control import SimControl
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._kernel import URGENT, Event, ScheduledEvent

DEFAULT_STARTUP_S: Final = 90.0
"""Provisioning plus model load of a restarted replica (an 8B model from local disk: ~30 s
to schedule the pod and start the engine, ~60 s to load weights and warm up)."""
FAULT_PRIORITY: Final = URGENT
"""Faults come before the steps of their instant, after arrivals scheduled earlier."""


class _Fault(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class CrashFault(_Fault):
    """``replica`` dies at ``at`` and is back ``startup_s`` later."""

    kind: Literal["crash"] = "crash"
    replica: str
    at: float = Field(ge=0.0)
    startup_s: float = Field(DEFAULT_STARTUP_S, ge=0.0)


class SlowFault(_Fault):
    """``replica``'s steps take ``factor`` times as long from ``from`` to ``to``."""

    kind: Literal["slow"] = "slow"
    replica: str
    factor: float = Field(gt=0.0, allow_inf_nan=False)
    start: float = Field(alias="from", ge=0.0)
    end: float = Field(math.inf, alias="to")

    @model_validator(mode="after")
    def _ordered(self) -> SlowFault:
        if not self.end > self.start:
            raise ValueError(f"'to' ({self.end}) must be after 'from' ({self.start})")
        return self


class BlackoutFault(_Fault):
    """Scrapes of ``replica`` stop updating from ``from`` to ``to``."""

    kind: Literal["blackout"] = "blackout"
    replica: str
    start: float = Field(alias="from", ge=0.0)
    end: float = Field(math.inf, alias="to")

    @model_validator(mode="after")
    def _ordered(self) -> BlackoutFault:
        if not self.end > self.start:
            raise ValueError(f"'to' ({self.end}) must be after 'from' ({self.start})")
        return self


class HangFault(_Fault):
    """``replica``'s process stops from ``from`` to ``to``: nothing it runs moves, nothing
    sent to it (requests, probes, scrapes) is answered until then."""

    kind: Literal["hang"] = "hang"
    replica: str
    start: float = Field(alias="from", ge=0.0)
    end: float = Field(math.inf, alias="to")

    @model_validator(mode="after")
    def _ordered(self) -> HangFault:
        if not self.end > self.start:
            raise ValueError(f"'to' ({self.end}) must be after 'from' ({self.start})")
        return self


class ErrorFault(_Fault):
    """``replica`` answers every new request with a 5xx from ``from`` to ``to`` while its
    process lives and its ``/health`` passes (the sim engine's ``--fault-error-status``).
    Resumed streams are not refused (a resume is rare and short; the model keeps them)."""

    kind: Literal["errors"] = "errors"
    replica: str
    start: float = Field(alias="from", ge=0.0)
    end: float = Field(math.inf, alias="to")

    @model_validator(mode="after")
    def _ordered(self) -> ErrorFault:
        if not self.end > self.start:
            raise ValueError(f"'to' ({self.end}) must be after 'from' ({self.start})")
        return self


class MtbfFault(_Fault):
    """Every replica crashes after exponential times with mean ``hours`` per GPU ÷ TP."""

    kind: Literal["mtbf"] = "mtbf"
    hours: float = Field(gt=0.0, allow_inf_nan=False)
    startup_s: float = Field(DEFAULT_STARTUP_S, ge=0.0)


class SpotFault(_Fault):
    """Every replica of a ``capacity: spot`` pool is reclaimed after exponential times,
    ``per_gpu_hour`` times per GPU-hour (× TP per replica), each announced ``notice_s``
    ahead; its replacement serves ``startup_s`` after it went."""

    kind: Literal["spot"] = "spot"
    per_gpu_hour: float = Field(gt=0.0, allow_inf_nan=False)
    notice_s: float = Field(60.0, ge=0.0, allow_inf_nan=False)
    startup_s: float = Field(DEFAULT_STARTUP_S, ge=0.0)
    unavailable_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """After each reclaim, the pool's spot GPUs stay short for an exponential time of this
    mean (reclaims come when the provider runs short); 0: always to be had."""


class SpotOutageFault(_Fault):
    """No spot GPU of pool ``model`` (every spot pool: ``None``) can be had from ``from``
    to ``to``; those running go on until reclaimed."""

    kind: Literal["spot_outage"] = "spot_outage"
    model: str | None = None
    start: float = Field(alias="from", ge=0.0)
    end: float = Field(math.inf, alias="to")

    @model_validator(mode="after")
    def _ordered(self) -> SpotOutageFault:
        if not self.end > self.start:
            raise ValueError(f"'to' ({self.end}) must be after 'from' ({self.start})")
        return self


Fault = Annotated[
    CrashFault
    | SlowFault
    | BlackoutFault
    | ErrorFault
    | HangFault
    | MtbfFault
    | SpotFault
    | SpotOutageFault,
    Field(discriminator="kind"),
]
_ADAPTER: Final[TypeAdapter[Fault]] = TypeAdapter(Fault)
FAULT_KINDS: Final = ("blackout", "crash", "errors", "hang", "mtbf", "slow", "spot", "spot_outage")
FLEET_WIDE: Final = (MtbfFault, SpotFault, SpotOutageFault)
"""Faults that name no replica: they draw over the fleet."""


def parse_fault(data: Mapping[str, Any] | str) -> Fault:
    """One fault from ``{crash: {replica: x, at: 300}}`` or ``"crash:replica=x,at=300"``.

    ``ValueError`` with a one-line message naming the fault and the field on bad input.
    """
    if isinstance(data, str):
        kind, _, rest = data.partition(":")
        fields: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"fault {data!r}: {item!r} is not key=value")
            fields[key.strip()] = value.strip()
        data = {kind.strip(): fields}
    if len(data) != 1:
        raise ValueError(f"a fault is one of {', '.join(FAULT_KINDS)} with its fields: {data!r}")
    ((kind, fields),) = data.items()
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r} (one of {', '.join(FAULT_KINDS)})")
    if not isinstance(fields, Mapping):
        raise ValueError(f"fault {kind}: fields must be a mapping, got {fields!r}")
    try:
        return _ADAPTER.validate_python({**fields, "kind": kind})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "fields"
        raise ValueError(f"fault {kind}: {where}: {first['msg']}") from None


def load_faults(path: Path | str) -> list[Fault]:
    """A scenario file: ``faults:`` followed by a list of faults."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, Mapping) or set(data) != {"faults"}:
        raise ValueError(f"{path}: a scenario file has one key, `faults:` (a list)")
    items = data["faults"] or []
    if not isinstance(items, list):
        raise ValueError(f"{path}: `faults:` must be a list")
    faults: list[Fault] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"{path}: faults[{i}]: expected a mapping, got {item!r}")
        try:
            faults.append(parse_fault(item))
        except ValueError as error:
            raise ValueError(f"{path}: faults[{i}]: {error}") from None
    return faults


def fault_spec(fault: Fault) -> dict[str, Any]:
    """A fault as report.json writes it (its YAML form; no infinities)."""
    fields = fault.model_dump(by_alias=True, exclude={"kind"})
    return {fault.kind: {k: (None if v == math.inf else v) for k, v in fields.items()}}


# -- the injector -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Crash:
    target: FaultInjector
    replica: int
    startup_s: float
    mtbf: bool = False
    preempted: bool = False
    """The provider took the replica's GPUs (a spot preemption), not a crash."""


@dataclass(frozen=True, slots=True)
class Notice:
    """A spot replica's preemption notice (of draw ``draw``: a later draw supersedes it)."""

    target: FaultInjector
    replica: int
    draw: int


@dataclass(frozen=True, slots=True)
class Restart:
    target: FaultInjector
    replica: int


@dataclass(frozen=True, slots=True)
class Market:
    """Pool ``pool``'s spot GPUs run short (``short``) or come back (one stretch of it)."""

    target: FaultInjector
    pool: str
    short: bool


@dataclass(frozen=True, slots=True)
class Takeover:
    """An on-demand stand-in's spot node serves: the replica moves to it."""

    target: FaultInjector
    replica: int


@dataclass(frozen=True, slots=True)
class Slow:
    target: FaultInjector
    replica: int
    factor: float


@dataclass(frozen=True, slots=True)
class Blackout:
    target: FaultInjector
    replica: int
    on: bool


@dataclass(frozen=True, slots=True)
class Errors:
    target: FaultInjector
    replica: int
    on: bool


@dataclass(frozen=True, slots=True)
class Hang:
    target: FaultInjector
    replica: int
    on: bool


class FaultInjector:
    """Plays a scenario's faults into one harness and its :class:`~gpufleet.sim.SimControl`.

    ``fresh(i)`` builds the model of replica ``i``'s restarted process. MTBF draws come from
    ``rng`` (one per run, used by nothing else), so a seed gives one run, faults included.
    """

    __slots__ = (
        "_draws",
        "_fresh",
        "_gpus",
        "_harness",
        "_mtbf",
        "_pools",
        "_rng",
        "_routing",
        "_short",
        "_spot",
        "_spot_pools",
        "_standing",
        "billing",
        "crashes",
        "cut_by_preemption",
        "moved_to_spot",
        "notices",
        "preemptions",
        "stand_ins",
    )

    def __init__(
        self,
        harness: FleetHarness,
        routing: SimControl,
        *,
        fresh: Callable[[int], ReplicaModel],
        gpus: Sequence[int],
        rng: Random,
        pools: Sequence[str] = (),
        spot_pools: frozenset[str] = frozenset(),
    ) -> None:
        self._harness = harness
        self._routing = routing
        self._fresh = fresh
        self._gpus = list(gpus)
        self._rng = rng
        self._mtbf: MtbfFault | None = None
        self._spot: SpotFault | None = None
        self._pools = list(pools) or [""] * len(gpus)
        """Each replica's pool, in driver order (with ``gpus``)."""
        self._spot_pools = spot_pools
        """The pools whose replicas a ``spot`` fault reclaims (``capacity: spot``)."""
        self._draws: dict[int, int] = {}
        """Per spot replica, its current draw (a restart starts a new one)."""
        self.crashes = 0
        self.preemptions = 0
        self.cut_by_preemption = 0
        """Attempts still on a replica when the provider took it (abandoned in time: 0)."""
        self.notices: list[tuple[int, float, float]] = []
        """Each preemption: the replica, when its notice came, and its deadline."""
        self._short: dict[str, int] = {}
        """Per spot pool, the stretches of spot shortage now open (none: GPUs to be had)."""
        self._standing: set[int] = set()
        """Replicas on on-demand nodes standing in for spot ones (never reclaimed)."""
        self.stand_ins = 0
        """Reclaimed replicas given on-demand nodes (``spot.fallback: on_demand``)."""
        self.moved_to_spot = 0
        """Stand-ins moved back to spot nodes."""
        self.billing: Autoscaling | None = None
        """What bills the replicas' nodes (their capacity changes are told to it)."""
        routing.on_replace = self._replace

    def start(self, faults: Sequence[Fault]) -> None:
        """Schedule every fault (call after the harness and routing are started)."""
        names: dict[str, int] = {str(n): i for i, n in enumerate(self._routing.replica_ids)}
        kernel = self._harness.kernel
        events: list[ScheduledEvent] = []
        for fault in faults:
            if isinstance(fault, MtbfFault):
                if self._mtbf is not None:
                    raise ValueError("give at most one mtbf fault")
                self._mtbf = fault
                continue
            if isinstance(fault, SpotFault):
                if self._spot is not None:
                    raise ValueError("give at most one spot fault")
                self._spot = fault
                continue
            if isinstance(fault, SpotOutageFault):
                events += self._outage(fault)
                continue
            replica = names.get(fault.replica)
            if replica is None:
                known = ", ".join(names)
                raise ValueError(
                    f"fault {fault.kind}: no replica {fault.replica!r} (replicas: {known})"
                )
            events += self._scheduled(fault, replica)
        if self._mtbf is not None:
            for replica in range(len(self._gpus)):
                events.append(self._next_failure(kernel.now, replica))
        for replica in range(len(self._gpus)):
            events += self._next_notice(kernel.now, replica)
        kernel.schedule_all(sorted(events, key=lambda e: e.time))

    def _scheduled(self, fault: Fault, replica: int) -> list[ScheduledEvent]:
        """The events of one fault on replica ``replica``: its start, and its end if any."""
        on: Event
        off: Event
        match fault:
            case CrashFault():
                return [self._at(fault.at, Crash(self, replica, fault.startup_s))]
            case SlowFault():
                on, off = Slow(self, replica, fault.factor), Slow(self, replica, 1.0)
            case BlackoutFault():
                on, off = Blackout(self, replica, True), Blackout(self, replica, False)
            case ErrorFault():
                on, off = Errors(self, replica, True), Errors(self, replica, False)
            case HangFault():
                on, off = Hang(self, replica, True), Hang(self, replica, False)
            case _:
                raise AssertionError(fault)
        events = [self._at(fault.start, on)]
        if math.isfinite(fault.end):
            events.append(self._at(fault.end, off))
        return events

    def _outage(self, fault: SpotOutageFault) -> list[ScheduledEvent]:
        """A ``spot_outage``: its pool's (or every spot pool's) shortage, on and off."""
        if fault.model is not None and fault.model not in self._spot_pools:
            known = ", ".join(sorted(self._spot_pools)) or "none"
            raise ValueError(
                f"fault spot_outage: {fault.model!r} is not a spot pool (spot pools: {known})"
            )
        pools = sorted(self._spot_pools) if fault.model is None else [fault.model]
        events = [self._at(fault.start, Market(self, pool, True)) for pool in pools]
        if math.isfinite(fault.end):
            events += [self._at(fault.end, Market(self, pool, False)) for pool in pools]
        return events

    def _market(self, now: float, pool: str, short: bool) -> list[ScheduledEvent]:
        """One stretch of shortage opens or closes; the controller hears the first to open
        and the last to close."""
        was = self._short.get(pool, 0)
        self._short[pool] = now_short = max(0, was + (1 if short else -1))
        if (was == 0) == (now_short == 0):
            return []
        return self._routing.spot_market(now, pool, available=now_short == 0)

    def _replace(self, now: float, command: Replace) -> list[ScheduledEvent]:
        """The controller gives ``replica`` a node of ``capacity``: a reclaimed one starts
        again there ``startup_s`` on; a stand-in moves once its spot node serves."""
        entry = self._routing.replicas.by_id.get(command.replica)
        if entry is None or entry.driver is None:
            return []
        replica, capacity = entry.driver, command.capacity
        startup_s = DEFAULT_STARTUP_S if self._spot is None else self._spot.startup_s
        if self._harness.drivers[replica].down:
            self._bill(now, replica, capacity.value)
            if capacity is Capacity.ON_DEMAND and self._pools[replica] in self._spot_pools:
                self._standing.add(replica)
                self.stand_ins += 1
            return [ScheduledEvent(now + startup_s, FAULT_PRIORITY, Restart(self, replica))]
        if capacity is Capacity.SPOT and replica in self._standing:
            if self.billing is not None:  # the spot node starts beside the stand-in
                model = self._pools[replica]
                gpus = self._gpus[replica]
                self.billing.extra.append((model, capacity.value, now, now + startup_s, gpus))
            return [ScheduledEvent(now + startup_s, FAULT_PRIORITY, Takeover(self, replica))]
        return []

    def _takeover(self, now: float, replica: int) -> list[ScheduledEvent]:
        """A stand-in's spot node serves: the replica runs there from now on (its requests
        go on: the move is a planned one, done between requests)."""
        if replica not in self._standing:
            return []
        self._standing.discard(replica)
        self.moved_to_spot += 1
        self._bill(now, replica, Capacity.SPOT.value)
        return self._next_notice(now, replica)

    def _bill(self, now: float, replica: int, capacity: str) -> None:
        if self.billing is not None:
            self.billing.set_capacity(now, self._routing.replica_ids[replica], capacity)

    def replica_added(
        self, now: float, replica: int, gpus: int, pool: str, on_demand: bool = False
    ) -> None:
        """Replica ``replica`` (``gpus`` GPUs) of ``pool`` joined the fleet: MTBF applies to
        it too, and spot preemptions if ``pool`` is a spot pool (``on_demand``: bought on
        demand while spot GPUs were short, it is never reclaimed)."""
        self._gpus.append(gpus)
        self._pools.append(pool)
        assert len(self._gpus) == replica + 1, (len(self._gpus), replica)
        if on_demand:
            self._standing.add(replica)
        events = [] if self._mtbf is None else [self._next_failure(now, replica)]
        events += self._next_notice(now, replica)
        if events:
            self._harness.kernel.schedule_all(events)

    def _at(self, time: float, event: Event) -> ScheduledEvent:
        return ScheduledEvent(max(time, self._harness.kernel.now), FAULT_PRIORITY, event)

    def _next_failure(self, now: float, replica: int) -> ScheduledEvent:
        mtbf = self._mtbf
        assert mtbf is not None
        mean_s = mtbf.hours * 3600.0 / self._gpus[replica]
        at = now + self._rng.expovariate(1.0 / mean_s)
        return ScheduledEvent(at, FAULT_PRIORITY, Crash(self, replica, mtbf.startup_s, True))

    def _next_notice(self, now: float, replica: int) -> list[ScheduledEvent]:
        """Replica ``replica``'s next preemption notice, if it is a spot pool's (a new draw:
        any notice drawn before for it is void)."""
        spot = self._spot
        if spot is None or self._pools[replica] not in self._spot_pools:
            return []
        if replica in self._standing:
            return []  # on an on-demand node: nothing to reclaim (a new draw voids the old)
        draw = self._draws[replica] = self._draws.get(replica, 0) + 1
        rate = spot.per_gpu_hour * self._gpus[replica] / 3600.0
        at = now + self._rng.expovariate(rate)
        return [ScheduledEvent(at, FAULT_PRIORITY, Notice(self, replica, draw))]

    def _notice(self, now: float, event: Notice) -> list[ScheduledEvent]:
        """The provider will take replica ``replica`` ``notice_s`` from now: the controller
        hears it now, the crash comes then."""
        spot, replica, harness = self._spot, event.replica, self._harness
        assert spot is not None
        driver = harness.drivers[replica]
        stopped = self._routing.state(replica) is ReplicaState.STOPPED  # scaled in
        if replica in self._standing:
            return []  # it moved to an on-demand node meanwhile
        if self._draws.get(replica) != event.draw or driver.down or stopped:
            return []  # superseded by a restart's draw, or nothing to take
        if not harness.active:
            return []
        self.preemptions += 1
        at = now + spot.notice_s
        self.notices.append((replica, now, at))
        out = self._routing.preempting(now, replica, at)
        out.append(
            ScheduledEvent(at, FAULT_PRIORITY, Crash(self, replica, spot.startup_s, False, True))
        )
        return out

    def _reclaimed(self, now: float, replica: int) -> list[ScheduledEvent]:
        """The provider took ``replica``'s node (no bill until another): spot GPUs may run
        short for a while (``unavailable_s``), then the controller says what replaces it."""
        spot = self._spot
        assert spot is not None
        self._bill(now, replica, "")
        out: list[ScheduledEvent] = []
        if spot.unavailable_s > 0 and self._harness.active:
            pool = self._pools[replica]
            out += self._market(now, pool, True)
            until = now + self._rng.expovariate(1.0 / spot.unavailable_s)
            out.append(ScheduledEvent(until, FAULT_PRIORITY, Market(self, pool, False)))
        return out + self._routing.reclaimed(now, replica)

    def _restart(self, now: float, replica: int) -> list[ScheduledEvent]:
        """Replica ``replica`` is back (a new process, or a new spot node): its next draws."""
        harness = self._harness
        harness.drivers[replica].restart(now)
        self._routing.replica_up(now, replica)
        if not harness.active:
            return []
        events = [] if self._mtbf is None else [self._next_failure(now, replica)]
        return events + self._next_notice(now, replica)

    def _hang(self, now: float, replica: int, on: bool) -> list[ScheduledEvent]:
        """Replica ``replica``'s process stops (``on``) or goes on."""
        driver, hung = self._harness.drivers[replica], self._routing.hung
        if not on:
            hung.discard(replica)
            return driver.wake(now)
        if not driver.down:
            driver.hang(now)
            hung.add(replica)
        return []

    def on_event(  # noqa: PLR0911, PLR0912 - one case per event
        self, now: float, event: Event
    ) -> list[ScheduledEvent]:
        harness, routing = self._harness, self._routing
        match event:
            case Crash(replica=replica, startup_s=startup_s):
                driver = harness.drivers[replica]
                gone = routing.state(replica) is ReplicaState.STOPPED  # scaled in
                if driver.down or gone or (event.mtbf and not harness.active):
                    return []
                if not event.preempted:
                    self.crashes += 1
                routing.hung.discard(replica)  # a hung process can be killed: the next is not
                lost = driver.crash(now, self._fresh(replica))
                if event.preempted:
                    self.cut_by_preemption += len(lost)
                out = harness.lose(now, replica, lost)  # failures reach health first
                routing.replica_down(now, replica)
                if event.preempted:  # the node is gone: the controller says what replaces it
                    return out + self._reclaimed(now, replica)
                out.append(ScheduledEvent(now + startup_s, FAULT_PRIORITY, Restart(self, replica)))
                return out
            case Restart(replica=replica):
                return self._restart(now, replica)
            case Market(pool=pool, short=short):
                return self._market(now, pool, short)
            case Takeover(replica=replica):
                return self._takeover(now, replica)
            case Notice():
                return self._notice(now, event)
            case Hang(replica=replica, on=on):
                return self._hang(now, replica, on)
            case Slow(replica=replica, factor=factor):
                harness.drivers[replica].model.set_slowdown(factor)
            case Blackout(replica=replica, on=on) | Errors(replica=replica, on=on):
                affected = routing.blackout if isinstance(event, Blackout) else routing.erroring
                if on:
                    affected.add(replica)
                else:
                    affected.discard(replica)
            case _:
                raise AssertionError(event)
        return []
