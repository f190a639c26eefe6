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
              ─► Restart @ + startup_s (a replacement node) ─► the next draw
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

from gpufleet.engine.model import ReplicaModel
from gpufleet.fleet import ReplicaState
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


Fault = Annotated[
    CrashFault | SlowFault | BlackoutFault | ErrorFault | HangFault | MtbfFault | SpotFault,
    Field(discriminator="kind"),
]
_ADAPTER: Final[TypeAdapter[Fault]] = TypeAdapter(Fault)
FAULT_KINDS: Final = ("blackout", "crash", "errors", "hang", "mtbf", "slow", "spot")
FLEET_WIDE: Final = (MtbfFault, SpotFault)
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
        "_spot",
        "_spot_pools",
        "crashes",
        "cut_by_preemption",
        "notices",
        "preemptions",
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

    def replica_added(self, now: float, replica: int, gpus: int, pool: str) -> None:
        """Replica ``replica`` (``gpus`` GPUs) of ``pool`` joined the fleet: MTBF applies to
        it too, and spot preemptions if ``pool`` is a spot pool."""
        self._gpus.append(gpus)
        self._pools.append(pool)
        assert len(self._gpus) == replica + 1, (len(self._gpus), replica)
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

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
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
                out.append(ScheduledEvent(now + startup_s, FAULT_PRIORITY, Restart(self, replica)))
                return out
            case Restart(replica=replica):
                return self._restart(now, replica)
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
