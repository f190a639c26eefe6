"""Autoscaling in the simulator: the modelled runtime that carries out the controller's
``Scale`` commands.

The pool controller (``gpufleet.control``) decides, as it does live, every ``interval`` and
at each decision's ``next_at``; this module is the runtime's side (the local runtime's twin)::

    Scale(decision) ─► promote: standby ─(startup.promote)─► serving
                                    cold_starts: new ─(provision + load)─► serving
                                    prewarm_starts: new ─(provision + load)─► standby
                                    drain: no new requests ─(in-flight 0)─► gone

Every replica of every pool — static ones too — is an :class:`Instance` with the phases it
went through, so the bill is one rule: a replica costs ``tp`` GPUs from the moment it is
provisioned until it leaves (or the run ends), whatever it does meanwhile (provisioning,
loading, standing by, serving, restarting after a crash, draining). docs/simulator.md.

Simplifications: a drained replica leaves when its last request ends (no deadline: the
simulator never cuts a request); scale to zero is not modelled (an autoscaled pool starts
with at least one replica and the policy keeps ``min_replicas``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from gpufleet.config import ModelConfig, StartupConfig
from gpufleet.control import (
    NO_BUY,
    Scale,
    ScaleDecision,
    ScaleDirection,
    Standby,
    decision_record,
)
from gpufleet.fleet import ReplicaId
from gpufleet.sim._control import SimControl
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._kernel import URGENT, Event, ScheduledEvent

SCALE_PRIORITY: Final = URGENT
"""Replicas join and decisions run before the steps of their instant (like scrapes)."""
MAX_LOGGED_EVENTS: Final = 5000
"""Scale events kept in the report per pool (the counts are always complete)."""


class Phase(StrEnum):
    """Where a replica is in its life, as the bill and the plots count it."""

    COLD = "cold"
    """Cold start: provisioning the machine, then loading the model; no traffic."""
    WARMING = "warming"
    """A prewarm standby provisioning and loading."""
    STANDBY = "standby"
    """Initialised, not routed: joins in ``startup.promote`` seconds."""
    PROMOTING = "promoting"
    """A standby joining the routable pool."""
    SERVING = "serving"
    DRAINING = "draining"
    """Takes no new request; leaves when its last one ends."""
    GONE = "gone"


STARTING_PHASES: Final = frozenset({Phase.COLD, Phase.PROMOTING})
"""Replicas the policy counts as capacity to come (``ReplicaState.STARTING``)."""
STANDBY_PHASES: Final = frozenset({Phase.WARMING, Phase.STANDBY})


@dataclass(slots=True)
class Instance:
    """One replica (or standby) of a pool, from provisioning to leaving."""

    id: ReplicaId
    model: str
    gpus: int
    phase: Phase
    provisioned_at: float
    """Charged from here."""
    via: str
    """``initial`` (there at t = 0), ``cold`` (a cold start), ``promoted`` (a standby)."""
    asked_at: float | None = None
    """The decision that asked for it as capacity (cold start or promotion)."""
    ready_since: float | None = None
    """A standby: when its model finished loading."""
    warm_at: float | None = None
    """A standby: when its model finishes (or finished) loading."""
    serving_at: float | None = None
    gone_at: float | None = None
    driver: int | None = None
    history: list[tuple[float, Phase]] = field(default_factory=list)
    """``(since, phase)`` in order: the bill by phase."""
    capacity: list[tuple[float, str]] = field(default_factory=list)
    """``(since, capacity)`` in order: ``spot`` or ``on_demand`` (what its node is bought
    as, its pool's unless it stands in: docs/spot.md), or ``""`` (no node: a reclaimed
    replica waiting for spot GPUs, not billed)."""

    def enter(self, now: float, phase: Phase) -> None:
        self.phase = phase
        self.history.append((now, phase))
        if phase is Phase.GONE:
            self.gone_at = now


@dataclass(frozen=True, slots=True)
class Joined:
    """A replica finished its cold start, warm-up or promotion (``phase`` it was in)."""

    target: Autoscaling
    instance: Instance
    phase: Phase


@dataclass(slots=True)
class _Episode:
    start: float
    end: float | None = None


@dataclass(slots=True)
class PoolScaling:
    """One autoscaled pool: its settings, what it decided and measured."""

    model: str
    target_utilisation: float
    """The controller's autoscaling target (the over-target measure)."""
    config: dict[str, Any]
    """The controller's autoscaling settings, as report.json shows them."""
    startup: StartupConfig
    decisions: int = 0
    events: list[dict[str, object]] = field(default_factory=list)
    scale_ups: int = 0
    scale_downs: int = 0
    promoted: int = 0
    cold_starts: int = 0
    prewarm_starts: int = 0
    drained: int = 0
    held_starts: int = 0
    """Starts its decisions asked for while no spot GPU could be had (``fallback: wait``)."""
    over: list[_Episode] = field(default_factory=list)
    """Stretches in which the stable window's load per ready replica was above target."""
    last: ScaleDecision | None = None


class Autoscaling:
    """Every pool's replicas as instances, and the autoscaled pools' actuator.

    ``new_driver(model, on_demand)`` adds a replica of ``model`` to the harness and the
    simulation's bookkeeping (driver list, per-replica samples, faults: ``on_demand``, one
    added to a spot pool on demand, is never reclaimed) and returns its driver index.
    """

    def __init__(
        self,
        models: Sequence[ModelConfig],
        harness: FleetHarness,
        control: SimControl,
        *,
        new_driver: Callable[[str, bool], int],
        interval: float,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the autoscaling interval must be positive, got {interval}")
        self._harness = harness
        self._control = control
        self._new_driver = new_driver
        self.interval = interval
        self.instances: list[Instance] = []
        self._by_id: dict[ReplicaId, Instance] = {}
        self.pools: dict[str, PoolScaling] = {}
        self._capacity = {m.name: m.capacity.value for m in models}
        self.stand_ins: set[ReplicaId] = set()
        """Replicas it added on demand to a spot pool short of spot GPUs (never reclaimed)."""
        self.extra: list[tuple[str, str, float, float, int]] = []
        """Nodes billed beside a replica's own: ``(model, capacity, from, to, gpus)`` (a
        spot node starting while its on-demand stand-in still serves)."""
        ids = control.replica_ids
        for entry in models:
            for k in control.members(entry.name):
                inst = Instance(ids[k], entry.name, entry.tp, Phase.SERVING, 0.0, "initial")
                inst.history.append((0.0, Phase.SERVING))
                inst.capacity.append((0.0, self._capacity[entry.name]))
                inst.serving_at, inst.driver = 0.0, k
                self._track(inst)
            scale = control.control.pools[entry.name].settings.autoscale
            if scale is not None:  # the controller decides for this pool
                config = scale.model_dump(mode="json")
                self.pools[entry.name] = PoolScaling(
                    entry.name, scale.target_utilisation, config, entry.startup
                )
        self._gpus = {m.name: m.tp for m in models}
        control.on_scale = self.act
        control.on_wake = self.retire_drained

    def _track(self, inst: Instance) -> None:
        self.instances.append(inst)
        self._by_id[inst.id] = inst

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, Joined), event
        inst, phase = event.instance, event.phase
        if inst.phase is not phase:
            return []  # drained (cancelled) while starting
        if phase is Phase.WARMING:
            inst.ready_since = now
            inst.enter(now, Phase.STANDBY)
            self._tell_standbys(now, inst.model)
        else:
            self._serve(now, inst)
        return []

    def act(self, now: float, command: Scale) -> None:
        """Carry out one of the controller's decisions for an autoscaled pool."""
        decision = command.decision
        pool = self.pools[decision.model]
        pool.decisions += 1
        pool.last = decision
        self._measure(now, pool, decision)
        self._act(now, pool, command)

    def _tell_standbys(self, now: float, model: str) -> None:
        standbys: list[Standby] = []
        for inst in self.instances:
            if inst.model == model and inst.phase in STANDBY_PHASES:
                ready = inst.phase is Phase.STANDBY
                since = inst.ready_since if ready and inst.ready_since is not None else 0.0
                standbys.append(Standby(inst.id, ready, since if ready else inst.provisioned_at))
        self._control.standbys(now, model, tuple(standbys))

    def _act(self, now: float, pool: PoolScaling, command: Scale) -> None:
        decision, view, buy = command.decision, command.view, command.buy
        startup, events = pool.startup, []
        cold, prewarm = decision.cold_starts, decision.prewarm_starts
        if buy == NO_BUY:  # no spot GPU to be had: the starts wait for a later decision
            pool.held_starts += cold + prewarm
            cold = prewarm = 0
        capacity = buy or None
        for rid in decision.promote:
            inst = self._by_id[rid]
            inst.asked_at = now
            inst.via = "promoted"
            inst.enter(now, Phase.PROMOTING)
            self._control.promoting(now, pool.model, rid)
            pool.promoted += 1
            # A standby still warming finishes loading first, then joins.
            warm = now if inst.warm_at is None else max(now, inst.warm_at)
            events.append(self._join_at(warm + startup.promote, inst))
        for _ in range(cold):
            inst = self._provision(now, pool.model, Phase.COLD, "cold", capacity)
            inst.asked_at = now
            pool.cold_starts += 1
            events.append(self._join_at(now + startup.cold, inst))
        for _ in range(prewarm):
            inst = self._provision(now, pool.model, Phase.WARMING, "standby", capacity)
            inst.warm_at = now + startup.cold
            pool.prewarm_starts += 1
            events.append(self._join_at(now + startup.cold, inst))
        for rid in decision.drain:
            self._drain(now, self._by_id[rid])
            pool.drained += 1
        self._harness.kernel.schedule_all(events)
        if decision.promote or prewarm:
            self._tell_standbys(now, pool.model)
        if decision.direction is not ScaleDirection.HOLD:
            if decision.direction is ScaleDirection.UP:
                pool.scale_ups += 1
            else:
                pool.scale_downs += 1
            if len(pool.events) < MAX_LOGGED_EVENTS:
                pool.events.append(decision_record(decision, view))

    def _provision(
        self, now: float, model: str, phase: Phase, via: str, capacity: str | None = None
    ) -> Instance:
        control = self._control
        rid = control.provision(now, model) if phase is Phase.COLD else control.next_name(model)
        inst = Instance(rid, model, self._gpus[model], phase, now, via)
        inst.history.append((now, phase))
        bought = self._capacity[model] if capacity is None else capacity
        inst.capacity.append((now, bought))
        if bought != self._capacity[model]:
            self.stand_ins.add(rid)  # on demand in a spot pool: never reclaimed
        self._track(inst)
        return inst

    def _join_at(self, at: float, inst: Instance) -> ScheduledEvent:
        return ScheduledEvent(at, SCALE_PRIORITY, Joined(self, inst, inst.phase))

    def _serve(self, now: float, inst: Instance) -> None:
        if not self._harness.active:  # the run is over: nothing to serve
            inst.enter(now, Phase.GONE)
            return
        k = self._new_driver(inst.model, inst.id in self.stand_ins)
        joined = self._control.add_replica(now, inst.model, inst.id)
        assert joined == k, (joined, k)
        inst.driver = k
        inst.serving_at = now
        inst.enter(now, Phase.SERVING)

    def _drain(self, now: float, inst: Instance) -> None:
        """Stop routing to ``inst``; it leaves when its in-flight requests are done. One
        still starting is cancelled at once (it never served)."""
        if inst.phase in STARTING_PHASES or inst.driver is None:
            inst.enter(now, Phase.GONE)
            self._control.cancel(now, inst.id)
            return
        self._control.drain_replica(now, inst.driver)
        inst.enter(now, Phase.DRAINING)
        self._retire(now, inst)

    def retire_drained(self, now: float) -> None:
        """Drained replicas whose last request ended leave (before each decision)."""
        for inst in self.instances:
            if inst.phase is Phase.DRAINING:
                self._retire(now, inst)

    def _retire(self, now: float, inst: Instance) -> None:
        k = inst.driver
        assert k is not None
        if self._harness.drivers[k].num_requests:
            return
        drained_at = inst.history[-1][0]
        left = max(drained_at, min(now, self._control.last_end(k)))
        self._control.remove_replica(now, k)
        inst.enter(left, Phase.GONE)

    # -- measures ---------------------------------------------------------------------------

    def _measure(self, now: float, pool: PoolScaling, decision: ScaleDecision) -> None:
        """Over-target stretches: the stable window's load per ready replica above target."""
        inputs = decision.inputs
        target = pool.target_utilisation
        over = inputs.ready > 0 and inputs.stable_load / inputs.ready > target
        open_ = pool.over[-1] if pool.over and pool.over[-1].end is None else None
        if over and open_ is None:
            pool.over.append(_Episode(now))
        elif not over and open_ is not None:
            open_.end = now

    def counts(self, model: str) -> dict[str, int]:
        """Replicas of ``model`` by what they do now (for the timeline)."""
        out = {"serving": 0, "starting": 0, "standby": 0, "draining": 0}
        for inst in self.instances:
            if inst.model != model or inst.phase is Phase.GONE:
                continue
            if not inst.capacity[-1][1]:  # reclaimed, waiting for spot GPUs: to come
                out["starting"] += 1
            elif inst.phase is Phase.SERVING:
                out["serving"] += 1
            elif inst.phase in STARTING_PHASES:
                out["starting"] += 1
            elif inst.phase in STANDBY_PHASES:
                out["standby"] += 1
            else:
                out["draining"] += 1
        return out

    def serving_s(self, replica: ReplicaId, end: float) -> float:
        """Seconds ``replica`` was in the fleet taking or finishing requests, up to ``end``."""
        inst = self._by_id.get(replica)
        if inst is None or inst.serving_at is None:
            return 0.0
        left = end if inst.gone_at is None else min(inst.gone_at, end)
        return max(0.0, left - inst.serving_at)

    def charged_gpus(self) -> int:
        """GPUs billed now: every replica's that has a node (not gone, not waiting)."""
        return sum(
            i.gpus for i in self.instances if i.phase is not Phase.GONE and i.capacity[-1][1]
        )

    def set_capacity(self, now: float, replica: ReplicaId, capacity: str) -> None:
        """``replica``'s node is ``capacity`` from ``now`` (``""``: it has none)."""
        inst = self._by_id[replica]
        inst.capacity.append((now, capacity))

    def bill(self, model: str, end: float) -> dict[str, float]:
        """GPU-seconds of ``model``'s replicas up to ``end``, by what they were doing."""
        out = {"serving": 0.0, "starting": 0.0, "standby": 0.0, "draining": 0.0}
        for gpu_s, phase, _ in self._spans(model, end):
            out[_BILL_KEY[phase]] += gpu_s
        for _, _, since, until, gpus in self._extra(model):
            out["starting"] += max(0.0, min(until, end) - min(since, end)) * gpus
        return out

    def bill_by_capacity(self, model: str, end: float) -> dict[str, float]:
        """GPU-seconds of ``model``'s replicas up to ``end``, by what their nodes are."""
        out: dict[str, float] = {}
        for gpu_s, _, capacity in self._spans(model, end):
            out[capacity] = out.get(capacity, 0.0) + gpu_s
        for _, capacity, since, until, gpus in self._extra(model):
            span = max(0.0, min(until, end) - min(since, end)) * gpus
            out[capacity] = out.get(capacity, 0.0) + span
        return out

    def _extra(self, model: str) -> list[tuple[str, str, float, float, int]]:
        return [x for x in self.extra if x[0] == model]

    def _spans(self, model: str, end: float) -> list[tuple[float, Phase, str]]:
        """``(GPU-seconds, phase, capacity)`` of each billed stretch of ``model``'s replicas
        (a stretch without a node is not billed)."""
        out: list[tuple[float, Phase, str]] = []
        for inst in self.instances:
            if inst.model != model:
                continue
            # the phase and capacity marks, merged: each stretch has one of each
            cuts = sorted({t for t, _ in inst.history} | {t for t, _ in inst.capacity})
            phases, capacities = iter(inst.history), iter(inst.capacity)
            phase_mark, cap_mark = next(phases), next(capacities)
            next_phase, next_cap = next(phases, None), next(capacities, None)
            for since, until in itertools.pairwise([*cuts, math.inf]):
                while next_phase is not None and next_phase[0] <= since:
                    phase_mark, next_phase = next_phase, next(phases, None)
                while next_cap is not None and next_cap[0] <= since:
                    cap_mark, next_cap = next_cap, next(capacities, None)
                phase, capacity = phase_mark[1], cap_mark[1]
                if phase is Phase.GONE:
                    break
                span = max(0.0, min(until, end) - min(since, end))
                if capacity and span > 0:
                    out.append((span * inst.gpus, phase, capacity))
        return out

    def report(self, model: str, end: float) -> dict[str, Any] | None:
        """The ``autoscale`` section of one pool in report.json (``None``: not autoscaled)."""
        pool = self.pools.get(model)
        if pool is None:
            return None
        lags = sorted(
            i.serving_at - i.asked_at
            for i in self.instances
            if i.model == model and i.serving_at is not None and i.asked_at is not None
        )
        by_via = {
            via: sorted(
                i.serving_at - i.asked_at
                for i in self.instances
                if i.model == model
                and i.via == via
                and i.serving_at is not None
                and i.asked_at is not None
            )
            for via in ("promoted", "cold")
        }
        episodes = [(e.start, e.end if e.end is not None else end) for e in pool.over]
        durations = sorted(max(0.0, b - a) for a, b in episodes)
        return {
            "config": pool.config,
            "startup": pool.startup.model_dump(mode="json"),
            "interval_s": self.interval,
            "decisions": pool.decisions,
            "scale_ups": pool.scale_ups,
            "scale_downs": pool.scale_downs,
            "promoted": pool.promoted,
            "cold_starts": pool.cold_starts,
            "prewarm_starts": pool.prewarm_starts,
            "drained": pool.drained,
            "held_starts": pool.held_starts,
            "lag": {
                "decision_to_serving_s": _stats(lags),
                "promoted_s": _stats(by_via["promoted"]),
                "cold_s": _stats(by_via["cold"]),
                "over_target": {
                    "episodes": len(durations),
                    "total_s": _r(math.fsum(durations)),
                    **_stats(durations),
                },
            },
            "events": pool.events,
        }


_BILL_KEY: Final = {
    Phase.COLD: "starting",
    Phase.WARMING: "standby",
    Phase.STANDBY: "standby",
    Phase.PROMOTING: "starting",
    Phase.SERVING: "serving",
    Phase.DRAINING: "draining",
}


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, p50, p99 (lower rank) and max of sorted ``values``."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p99": None, "max": None}
    n = len(values)
    return {
        "n": n,
        "mean": _r(math.fsum(values) / n),
        "p50": _r(values[math.floor(0.5 * (n - 1))]),
        "p99": _r(values[math.floor(0.99 * (n - 1))]),
        "max": _r(values[-1]),
    }


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
