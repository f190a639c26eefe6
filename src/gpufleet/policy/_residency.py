"""Model residency: which replicas keep their model on the GPU, which sleep, which wake.

::

    policy = ResidencyPolicy()
    decision = policy.decide(now, ResidencyView(residents, demand))
    decision.sleep      # ((replica, level, reason), ...): drain, then POST /sleep?level=N
    decision.wake       # (replica, ...): POST /wake_up now (the memory is free)
    decision.next_at    # decide again then at the latest (an idle timer, a min_awake end)

A *slot* is one GPU (or TP group) whose memory several engines share: replica ``i`` of
every pool that names the same ``residency.slots`` sits on slot ``i``. An engine holds its
``memory`` share of the slot (its ``gpu_memory_utilization``) while serving, draining or
waking, and next to nothing asleep (vLLM's sleep mode releases the weights and the KV
cache). The conserved quantity: on every slot the shares held add up to at most 1.

The decision, level-triggered (the same view gives the same decision):

1. **Overcommit** (engines start awake): a slot holding more than 1 puts its least valuable
   residents to sleep until it fits.
2. **Wake on demand**: a pool with held requests and no replica serving or waking gets one
   woken (not one whose wakes failed, until its back-off ends) — the asleep replica whose
   slot needs the cheapest evictions (none: a slot with room; the price: value, and a
   drain, below). Evictions never touch an ``always``
   resident; one woken less than ``min_awake`` seconds ago is evicted only once that has
   passed (hysteresis: two models alternating on one slot take turns of at least that
   long instead of thrashing; an engine that started awake was woken for no one and is
   not held). The wait never moves the eviction onto a more valuable resident that happens
   to be out of its ``min_awake`` sooner. The wake itself is sent once the memory is free.
3. **Idle**: an ``on_demand`` replica with no request in flight for ``idle`` seconds sleeps.

A resident chosen to sleep with requests in flight *drains* first (no new request, the
controller sends the sleep when the last one ends): a replica never drops a request.

**Which resident to evict** — the least valuable, where::

    value = miss_cost × wake_seconds × demand_rate / memory      (ties: least recently used)

the expected cost per second of *not* having it resident (a request for it then waits a
wake: ``wake_seconds``, weighted by the fleet file's ``miss_cost``, at ``demand_rate``
requests per second), per share of memory its eviction frees. This is GreedyDual-Size-
Frequency, the web-cache rule for objects of unequal size and fetch cost: plain LRU would
evict a 70B model (a 37 s reload) as readily as an 8B one (4 s), and plain LFU never forgets
a model that was busy yesterday. ``demand_rate`` decays with a half-life
(:data:`DEMAND_HALF_LIFE`), so recency enters through it; with no recent demand anywhere
the rule is LRU.

**A busy resident costs a drain.** Evicting a resident with requests in flight makes the
held requests wait for the last of them (its pool's observed ``drain_seconds``: seconds,
where a level-1 wake is 0.4 s). A wake weighs each candidate at its value plus, if busy::

    miss_cost(wanting) × held(wanting) × drain_seconds × missing_rate / memory

where ``missing_rate`` is the other pools' requests per second that find no replica awake:
the next eviction comes in about ``1 / missing_rate`` seconds, and the busy resident, idle
by then, would be its victim; evicting an idle, more valuable resident now costs the
difference in value for about that long. So a resident of like value that is idle goes
instead of a busy one, and a much more valuable one stays (with no other misses, or no
drain seen yet, the order is value alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.fleet import ReplicaId

DEMAND_HALF_LIFE: Final = 60.0
"""Seconds after which an arrival counts half in a pool's demand rate."""
_EPS: Final = 1e-9


class ResidencyMode(StrEnum):
    ALWAYS = "always"
    """The model stays on the GPU (the default: today's behaviour)."""
    ON_DEMAND = "on_demand"
    """The model sleeps when idle or evicted, and wakes when a request comes."""


class ResidencyConfig(BaseModel):
    """One pool's residency, as the fleet file writes it (docs/residency.md)::

    residency: {mode: on_demand, idle: 120, level: 1, slots: gpu-a, miss_cost: 2}
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: ResidencyMode = ResidencyMode.ALWAYS
    idle: float = Field(300.0, gt=0.0)
    """Seconds without a request in flight after which an ``on_demand`` replica sleeps."""
    level: Literal[1, 2] = 1
    """vLLM's sleep level: 1 keeps the weights in host memory (a wake copies them back over
    PCIe, ~0.4 s for 8B); 2 drops them (a wake reads the checkpoint again, ~4 s for 8B)."""
    slots: str | None = None
    """Pools that name the same ``slots`` share GPU slots: replica ``i`` of each on slot
    ``i``, their engines' ``gpu_memory_utilization`` summing to at most 1 among the awake."""
    miss_cost: float = Field(1.0, gt=0.0)
    """Weight of a request that finds this model asleep (a priority): a resident with a
    higher one is evicted later."""
    min_awake: float = Field(2.0, ge=0.0)
    """Seconds a woken replica stays awake before another model may evict it."""

    @property
    def on_demand(self) -> bool:
        return self.mode is ResidencyMode.ON_DEMAND


class Residency(StrEnum):
    """Where a replica's model is (a residency state, beside its runtime and health state)."""

    SERVING = "serving"
    """Awake and routable."""
    DRAINING = "draining"
    """Chosen to sleep: takes no new request, sleeps when the last one in flight ends."""
    SLEEPING_1 = "sleeping_1"
    """Asleep, weights in host memory (a wake is a copy over PCIe)."""
    SLEEPING_2 = "sleeping_2"
    """Asleep, weights dropped (a wake reads the checkpoint: a load)."""
    WAKING = "waking"
    """A wake (or load) was sent and has not finished."""
    UNLOADED = "unloaded"
    """No engine process (not started, or gone)."""


ASLEEP: Final = frozenset({Residency.SLEEPING_1, Residency.SLEEPING_2})
HOLDS_MEMORY: Final = frozenset({Residency.SERVING, Residency.DRAINING, Residency.WAKING})
"""States whose engine holds its share of the slot's GPU memory."""
AWAKE: Final = frozenset({Residency.SERVING, Residency.WAKING})
"""States that answer (or are about to answer) the pool's requests."""


def asleep_at(level: int) -> Residency:
    return Residency.SLEEPING_1 if level == 1 else Residency.SLEEPING_2


@dataclass(frozen=True, slots=True)
class Resident:
    """One replica as the residency policy sees it."""

    replica: ReplicaId
    pool: str
    slot: tuple[str, int]
    """Its GPU slot: (the ``slots`` name, or its own replica id; replica index)."""
    state: Residency
    since: float
    """When it entered ``state``."""
    in_flight: int
    last_used: float
    """When it last had a request in flight."""
    memory: float
    """Its share of the slot's GPU memory while awake."""
    config: ResidencyConfig
    woken: bool = True
    """It serves because a Wake woke it. An engine that started awake (or stayed awake
    after a failed sleep) was woken for no one: ``min_awake`` does not hold it."""
    retry_at: float = 0.0
    """Its last wakes failed: it is not woken again before this (a back-off)."""


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """What a pool's requests ask of residency."""

    held: int
    """Requests held for want of a serving replica."""
    rate: float
    """Arrivals per second, decayed (:class:`DemandMeter`)."""
    wake_seconds: float
    """What a wake of its replicas takes (observed, else a prior)."""
    held_since: float | None = None
    """When its oldest held request arrived (``None``: unknown, or none held)."""
    drain_seconds: float = 0.0
    """What evicting one of its replicas with requests in flight takes until the last
    ends (observed, else 0: no drain is charged before one is seen)."""


@dataclass(frozen=True, slots=True)
class ResidencyView:
    residents: tuple[Resident, ...]
    demand: Mapping[str, PoolDemand]


class SleepReason(StrEnum):
    IDLE = "idle"
    EVICTED = "evicted"
    """Another model needs the slot's memory."""
    OVERCOMMIT = "overcommit"
    """The slot's awake engines hold more than its memory (at start)."""


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    sleep: tuple[tuple[ReplicaId, int, SleepReason], ...] = ()
    """Replicas to put to sleep (drained first), at that level, and why."""
    wake: tuple[ReplicaId, ...] = ()
    """Replicas to wake now: their slot has the memory."""
    next_at: float | None = None


class DemandMeter:
    """A pool's arrival rate, exponentially decayed: ``rate(now)`` in requests per second."""

    __slots__ = ("_at", "_count")

    def __init__(self) -> None:
        self._count = 0.0
        self._at = 0.0

    def arrive(self, now: float) -> None:
        self._count = self._decayed(now) + 1.0
        self._at = now

    def rate(self, now: float) -> float:
        return self._decayed(now) * math.log(2) / DEMAND_HALF_LIFE

    def _decayed(self, now: float) -> float:
        if self._count == 0.0:
            return 0.0
        decay: float = 0.5 ** (max(0.0, now - self._at) / DEMAND_HALF_LIFE)
        return self._count * decay


def value(resident: Resident, demand: PoolDemand | None) -> float:
    """The expected cost per second of evicting ``resident`` (module docstring)."""
    if demand is None:
        return 0.0
    cost = resident.config.miss_cost * demand.wake_seconds * demand.rate
    return cost / max(resident.memory, _EPS)


class ResidencyPolicy:
    """Stateless: every decision is made from the view alone (level-triggered)."""

    def decide(self, now: float, view: ResidencyView) -> ResidencyDecision:
        slots: dict[tuple[str, int], _Slot] = {}
        for r in view.residents:
            slots.setdefault(r.slot, _Slot()).residents.append(r)
        choice = _Choice(now, view.demand, _missing(view))
        for slot in slots.values():
            choice.overcommit(slot)
        for pool in _wanting(view):
            choice.wake_one(pool, slots.values())
        for r in view.residents:
            idle_at = _idle_at(r)
            if idle_at is None or r.replica in choice.sleeps:
                continue
            if now >= idle_at:
                choice.sleeps[r.replica] = (r.config.level, SleepReason.IDLE)
            else:
                choice.later.append(idle_at)
        return ResidencyDecision(
            tuple((rid, level, why) for rid, (level, why) in choice.sleeps.items()),
            tuple(choice.wakes),
            min(choice.later, default=None),
        )


def _idle_at(r: Resident) -> float | None:
    """When ``r`` falls idle (``None``: it never does, or is not serving, or is busy)."""
    if not r.config.on_demand or r.state is not Residency.SERVING or r.in_flight:
        return None
    return r.last_used + r.config.idle


def _missing(view: ResidencyView) -> float:
    """Requests per second that find their model with no replica serving or waking: the
    rate of misses, each of which will want a slot."""
    awake = {r.pool for r in view.residents if r.state in AWAKE}
    pools = {r.pool for r in view.residents} - awake
    return math.fsum(d.rate for p in pools if (d := view.demand.get(p)) is not None)


def _wanting(view: ResidencyView) -> list[str]:
    """Pools with held requests and no replica serving or waking: the one whose oldest held
    request has waited longest first (first come, first served: a pool with one request
    held is not starved by pools that keep more), then most requests held, then by name."""
    awake = {r.pool for r in view.residents if r.state in AWAKE}
    pools = {r.pool for r in view.residents}
    wanting = [
        p for p in pools if p not in awake and (d := view.demand.get(p)) is not None and d.held
    ]

    def order(p: str) -> tuple[float, int, str]:
        d = view.demand[p]
        return (math.inf if d.held_since is None else d.held_since, -d.held, p)

    return sorted(wanting, key=order)


@dataclass(slots=True)
class _Slot:
    """One slot's residents and the memory this decision has promised on it so far."""

    residents: list[Resident] = field(default_factory=list)
    promised: float = 0.0
    """Memory of the wakes chosen here (sent now, or once evictions finish)."""
    sent: float = 0.0
    """Memory of the wakes sent now."""
    incoming: list[Resident] = field(default_factory=list)
    """The replicas of those wakes."""


class _Choice:
    """One decision's working sets: the sleeps and wakes chosen so far."""

    def __init__(self, now: float, demand: Mapping[str, PoolDemand], missing: float) -> None:
        self.now = now
        self.demand = demand
        self.missing = missing
        self.sleeps: dict[ReplicaId, tuple[int, SleepReason]] = {}
        self.wakes: list[ReplicaId] = []
        self.later: list[float] = []

    def _key(self, r: Resident) -> tuple[float, float, str]:
        """Eviction order: least valuable first, then least recently used, then by name."""
        return (value(r, self.demand.get(r.pool)), r.last_used, r.replica)

    def _price(self, r: Resident, waking: Resident) -> float:
        """What evicting ``r`` for ``waking``'s held requests costs: its value, and if it has
        requests in flight, the drain those held requests wait (its pool's observed
        ``drain_seconds``) spread over the time until the next miss elsewhere (the misses
        of the other pools with none awake): evicting a more valuable idle resident instead
        costs the difference in value for about that long, since the busy one, idle by
        then, would be the next miss's victim."""
        price = value(r, self.demand.get(r.pool))
        if r.in_flight and r.state is Residency.SERVING:
            wanting = self.demand[waking.pool]
            victim = self.demand.get(r.pool)
            drain = 0.0 if victim is None else victim.drain_seconds
            others = max(0.0, self.missing - wanting.rate)
            cost = waking.config.miss_cost * wanting.held * drain * others
            price += cost / max(r.memory, _EPS)
        return price

    def _after(self, slot: _Slot) -> float:
        """The slot's memory held once the sleeps chosen (now and before) are done."""
        kept = sum(
            r.memory for r in slot.residents if r.state in AWAKE and r.replica not in self.sleeps
        )
        return kept + slot.promised

    def _evictable(self, slot: _Slot) -> list[Resident]:
        """Serving ``on_demand`` residents not chosen yet, least valuable first (``min_awake``
        is the caller's to apply)."""
        out = [
            r
            for r in slot.residents
            if r.state is Residency.SERVING and r.config.on_demand and r.replica not in self.sleeps
        ]
        return sorted(out, key=self._key)

    def overcommit(self, slot: _Slot) -> None:
        held = self._after(slot)
        for r in self._evictable(slot):
            if held <= 1.0 + _EPS:
                return
            self.sleeps[r.replica] = (r.config.level, SleepReason.OVERCOMMIT)
            held -= r.memory

    def _plan(self, waking: Resident, slot: _Slot) -> list[Resident] | None:
        """The residents to evict so that ``waking`` fits once they sleep (``[]``: it fits,
        or will once those draining sleep); ``None``: not now (the rest are ``always``, or
        the least valuable are not evictable yet: awake for less than ``min_awake``, when
        that ends goes to ``later``, or still waking).

        The victims are the least valuable, whether or not they may be evicted now: the
        candidates include the replicas waking on the slot (sent before, or chosen earlier
        in this decision), and ``min_awake`` delays an eviction, it never redirects it.
        Otherwise, under load, the busiest model would be evicted: it is the one woken
        longest ago, and with several pools wanting one slot, the last of them would evict
        it while the others, less valuable, are still waking."""
        free = 1.0 - self._after(slot)
        plan: list[Resident] = []
        if waking.memory <= free + _EPS:
            return plan
        waking_now = [r for r in slot.residents if r.state is Residency.WAKING]
        candidates = [
            r for r in (*self._evictable(slot), *waking_now, *slot.incoming) if r.config.on_demand
        ]
        for r in sorted(candidates, key=lambda c: (self._price(c, waking), *self._key(c))):
            plan.append(r)
            free += r.memory
            if waking.memory <= free + _EPS:
                break
        else:
            return None
        if all(self._settled(r) for r in plan):
            return plan
        self.later.extend(  # a waking one's end is an event: Resident(serving)
            r.since + r.config.min_awake
            for r in plan
            if r.state is Residency.SERVING and not self._settled(r)
        )
        return None

    def _settled(self, r: Resident) -> bool:
        """Serving for at least ``min_awake``: ``r`` may be evicted. (Compared as the time
        it ends, the ``next_at`` asked for: ``now - since < min_awake`` can hold at
        ``now == since + min_awake`` in floating point, and the shell would call again at
        once, for ever.)"""
        if r.state is not Residency.SERVING:
            return False
        return not r.woken or self.now >= r.since + r.config.min_awake

    def wake_one(self, pool: str, slots: Iterable[_Slot]) -> None:
        """Wake one asleep replica of ``pool``: the one whose slot frees its memory at the
        least value; evict what that needs; send the wake now if the memory is free."""
        best: tuple[float, int, str, Resident, _Slot, list[Resident]] | None = None
        for slot in slots:
            for r in slot.residents:
                if r.pool != pool or r.state not in ASLEEP:
                    continue
                if r.retry_at > self.now:  # its wakes failed: not before its back-off ends
                    self.later.append(r.retry_at)
                    continue
                plan = self._plan(r, slot)
                if plan is None:
                    continue
                cost = math.fsum(self._price(e, r) for e in plan)
                if best is None or (cost, len(plan), r.replica) < best[:3]:
                    best = (cost, len(plan), r.replica, r, slot, plan)
        if best is None:
            return
        *_, chosen, slot, plan = best
        for e in plan:
            self.sleeps[e.replica] = (e.config.level, SleepReason.EVICTED)
        slot.promised += chosen.memory
        slot.incoming.append(chosen)
        held_now = sum(r.memory for r in slot.residents if r.state in HOLDS_MEMORY) + slot.sent
        if held_now + chosen.memory <= 1.0 + _EPS:
            slot.sent += chosen.memory
            self.wakes.append(chosen.replica)
