"""The residency controller: which replicas keep their model on the GPU, across pools.

::

    residency = ResidencyControl.of(fleet, pools)      # None: every pool is always resident
    commands += residency.after(now, event, arrived_in)  # after the pools took the event
    residency.next_wakeup()

Residency is decided above the pools because a GPU slot is shared by replicas of several
pools (``residency.slots``). After every event the fleet controller hands it, it reads what
the pools hold (requests held for want of a serving replica, attempts in flight per replica)
and asks :class:`~gpufleet.policy.ResidencyPolicy` for a decision, which it carries out::

    decision.sleep ─► DRAINING (the pool stops routing to it) ─► Sleep once nothing is in
                      flight ─► the engine reports Resident(sleeping_N) ─► SLEEPING_N
    decision.wake  ─► WAKING + Wake ─► Resident(serving) ─► SERVING: the pool routes to it,
                      its held requests first (held as for a starting replica: bounded by
                      ``gateway.autoscaler.hold_requests`` and ``hold_timeout``)

Each pool is told which of its replicas *rest* (any state but serving:
:meth:`PoolController.rest`). A replica the runtime reports with a new process is serving
(an engine starts awake); one with no process is ``unloaded``. The time a wake took (Wake to
``Resident(serving)``) is what the next eviction values a miss of that pool at, and of every
pool with the same weights (engine, model, GPU and ``tp``: their wakes copy the same bytes);
until one is seen, ``startup.load`` for a level-2 wake and a twentieth of it for level 1
(vLLM reports level-1 wakes 18–200× faster than a reload). Sharing matters: with a prior
per pool, a busy model whose wake was seen (0.4 s for 8B) would look cheaper to evict than
an idle twin still valued at the prior (3 s), and be evicted first.

The time a busy replica's eviction waited for its last request (chosen to sleep to Sleep
sent) is what the next wake charges for evicting a busy replica of that pool (averaged; a
pool with none seen gets the mean of the others', and 0 before any is seen): the policy
then prefers an idle resident of like value to a drain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpufleet.config import FleetConfig, ModelConfig
from gpufleet.control._events import Command, Event, Replicas, Tick
from gpufleet.control._pool import PoolController
from gpufleet.control._residency_events import Resident, Sleep, Wake
from gpufleet.fleet import ReplicaId
from gpufleet.policy import (
    ASLEEP,
    DemandMeter,
    PoolDemand,
    Residency,
    ResidencyDecision,
    ResidencyPolicy,
    ResidencyView,
)
from gpufleet.policy import Resident as ResidentView

_LEVEL_1_SPEEDUP: Final = 20.0
"""The prior of a level-1 wake: ``startup.load`` divided by this."""
_WAKE_EWMA: Final = 0.5
"""Weight of the newest observed wake time in a pool's estimate."""
WAKE_BACKOFF: Final = 1.0
"""Seconds before a replica whose wake failed is woken again; doubled for each failure in a
row, at most ``WAKE_BACKOFF_MAX`` (an engine that keeps refusing is not hammered, and a
held request's pool may wake another replica meanwhile)."""
WAKE_BACKOFF_MAX: Final = 30.0


@dataclass(slots=True)
class _Replica:
    id: ReplicaId
    pool: str
    slot: tuple[str, int]
    state: Residency
    since: float
    last_used: float
    incarnation: str | None
    busy: int = 0
    """Attempts in flight, as its pool counted them at the last event."""
    level: int = 1
    """The level it sleeps (or is to sleep) at."""
    reason: str = ""
    sleep_sent: bool = False
    wake_sent: float | None = None
    woken: bool = False
    """It serves because a Wake woke it (``min_awake`` holds it), not since it started."""
    drain_from: float | None = None
    """When it was chosen to sleep with requests in flight (its drain is being timed)."""
    failed_wakes: int = 0
    """Wakes in a row that failed (the engine still asleep after its Wake)."""
    retry_at: float = 0.0
    """Not woken again before this: ``WAKE_BACKOFF`` doubled per failed wake in a row."""


@dataclass(slots=True)
class ResidencyCounters:
    """What residency did (both shells report these)."""

    sleeps: int = 0
    wakes: int = 0
    wake_seconds: float = 0.0
    """Total time from Wake to Resident(serving), over ``wakes``."""
    evictions: int = 0
    failed_wakes: int = 0
    """Wakes the engine did not carry out (it reported itself still asleep)."""


def slot_of(replica: ReplicaId, pool: str, slots: str | None) -> tuple[str, int]:
    """``(slots, i)`` for replica ``<pool>-<i>`` of a pool that shares slots; a replica of a
    pool that does not, or whose id has no index, has a slot of its own."""
    head, _, index = replica.rpartition("-")
    if slots is None or head != pool or not index.isdigit():
        return (f"replica:{replica}", 0)
    return (slots, int(index))


class ResidencyControl:
    """Residency of the pools that sleep on demand or share GPU slots."""

    __slots__ = (
        "_drains",
        "_memory",
        "_models",
        "_next_at",
        "_observed",
        "_pools",
        "_replicas",
        "_resting",
        "counters",
        "meters",
        "policy",
        "version",
    )

    def __init__(self, models: Mapping[str, ModelConfig], pools: Mapping[str, PoolController]):
        self._models = dict(models)
        self._memory = {name: m.memory for name, m in models.items()}
        """Each pool's share of a slot (read once: ``memory`` parses the engine flags)."""
        self._pools = {name: pools[name] for name in models}
        self.policy = ResidencyPolicy()
        self.meters = {name: DemandMeter() for name in models}
        self.counters = ResidencyCounters()
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._observed: dict[tuple[str, str, str, int, int], float] = {}
        self._drains: dict[str, float] = {}
        """Per pool, what an eviction of a busy replica waited for its requests (EWMA)."""
        self._resting: dict[str, frozenset[ReplicaId]] = {}
        self._next_at: float | None = None
        self.version = 0
        """Moves whenever a replica's residency changes (a shell shows the states then)."""

    @classmethod
    def of(cls, fleet: FleetConfig, pools: Mapping[str, PoolController]) -> ResidencyControl | None:
        """The residency of ``fleet``'s pools; ``None`` when every pool is always resident
        on GPUs of its own (then nothing is added to any event's path)."""
        models = {
            m.name: m
            for m in fleet.models
            if m.residency.on_demand or m.residency.slots is not None
        }
        return cls(models, pools) if models else None

    def manages(self, pool: str) -> bool:
        return pool in self._models

    def next_wakeup(self) -> float | None:
        return self._next_at

    def states(self) -> dict[ReplicaId, Residency]:
        """Every managed replica's residency now (metrics, reports)."""
        return {rid: r.state for rid, r in self._replicas.items()}

    def wake_seconds(self, pool: str) -> float:
        """What the next eviction values a wake of ``pool`` at (seen, else the prior)."""
        return self._wake_seconds(pool, self._models[pool].residency.level)

    def replicas_of(self, pool: str) -> dict[ReplicaId, Residency]:
        return {rid: r.state for rid, r in self._replicas.items() if r.pool == pool}

    # -- the one entry point ------------------------------------------------------------

    def after(self, now: float, event: Event, arrived_in: str | None) -> list[Command]:
        """The fleet controller's pools have taken ``event`` (an arrival into pool
        ``arrived_in``): what residency does now."""
        if arrived_in is not None and arrived_in in self.meters:
            self.meters[arrived_in].arrive(now)
        if isinstance(event, Replicas) and event.model in self._models:
            self._runtime(now, event)
        elif isinstance(event, Resident):
            self._resident(now, event)
        elif isinstance(event, Tick) and (self._next_at is None or now < self._next_at):
            return []
        if isinstance(event, Replicas | Resident):
            self.version += 1
        out: list[Command] = []
        self._rest(now, out)  # a replica that woke takes its pool's held requests first
        self._count_busy(now, out)
        decision = self.policy.decide(now, self._view(now))
        self._apply(now, decision, out)
        self._rest(now, out)
        return out

    # -- what the shells report ---------------------------------------------------------

    def _runtime(self, now: float, event: Replicas) -> None:
        model = self._models[event.model]
        seen = {r.id: r for r in event.replicas}
        for rid in [rid for rid, r in self._replicas.items() if r.pool == event.model]:
            if rid not in seen:
                del self._replicas[rid]
        for rid, r in seen.items():
            known = self._replicas.get(rid)
            if known is not None and known.incarnation == r.incarnation:
                continue
            # a new process serves (an engine starts awake); no process: unloaded
            state = Residency.UNLOADED if r.incarnation is None else Residency.SERVING
            slot = slot_of(rid, event.model, model.residency.slots)
            self._replicas[rid] = _Replica(rid, event.model, slot, state, now, now, r.incarnation)

    def _resident(self, now: float, event: Resident) -> None:
        r = self._replicas.get(event.replica)
        if r is None:
            return
        if r.wake_sent is not None and event.state in ASLEEP:  # the wake failed: back off
            r.failed_wakes += 1
            self.counters.failed_wakes += 1
            backoff = WAKE_BACKOFF * 2 ** (r.failed_wakes - 1)
            r.retry_at = now + min(backoff, WAKE_BACKOFF_MAX)
        if event.state is Residency.SERVING:
            r.failed_wakes, r.retry_at = 0, 0.0
            if r.wake_sent is not None:
                took = now - r.wake_sent
                key = (*self._weights(r.pool), r.level)
                old = self._observed.get(key)
                self._observed[key] = took if old is None else old + _WAKE_EWMA * (took - old)
                self.counters.wakes += 1
                self.counters.wake_seconds += took
            r.last_used = now
            r.woken = r.wake_sent is not None
        elif event.state in ASLEEP:
            r.level = 1 if event.state is Residency.SLEEPING_1 else 2
        r.state, r.since = event.state, now
        r.sleep_sent, r.wake_sent = False, None

    # -- deciding and doing -------------------------------------------------------------

    def _count_busy(self, now: float, out: list[Command]) -> None:
        """Attempts in flight per replica, from the pools; a draining replica with none
        left is put to sleep now."""
        for r in self._replicas.values():
            busy = self._pools[r.pool].attempts.get(r.id, 0)
            if busy or r.busy:
                r.last_used = now  # in use since the last event, or just ended
            r.busy = busy
            if r.state is Residency.DRAINING and not busy and not r.sleep_sent:
                if r.drain_from is not None:
                    took, old = now - r.drain_from, self._drains.get(r.pool)
                    self._drains[r.pool] = took if old is None else old + _WAKE_EWMA * (took - old)
                    r.drain_from = None
                self._sleep(r, out)

    def _weights(self, pool: str) -> tuple[str, str, str, int]:
        """What a wake of ``pool``'s replicas copies: pools alike in it wake alike."""
        m = self._models[pool]
        return (m.engine.value, m.model or m.name, m.gpu, m.tp)

    def _wake_seconds(self, pool: str, level: int) -> float:
        seen = self._observed.get((*self._weights(pool), level))
        if seen is not None:
            return seen
        load = self._models[pool].startup.load
        return load if level == 2 else load / _LEVEL_1_SPEEDUP

    def drain_seconds(self, pool: str) -> float:
        """What evicting a busy replica of ``pool`` waits for its requests: seen for the
        pool, else the mean of what was seen for the others, else 0 (none charged)."""
        seen = self._drains.get(pool)
        if seen is not None:
            return seen
        return sum(self._drains.values()) / len(self._drains) if self._drains else 0.0

    def _view(self, now: float) -> ResidencyView:
        residents = tuple(
            ResidentView(
                r.id,
                r.pool,
                r.slot,
                r.state,
                r.since,
                r.busy,
                r.last_used,
                self._memory[r.pool],
                self._models[r.pool].residency,
                r.woken,
                r.retry_at,
            )
            for r in self._replicas.values()
        )
        demand = {
            name: PoolDemand(
                pool.held,
                self.meters[name].rate(now),
                self._wake_seconds(name, self._models[name].residency.level),
                pool.held_since,
                self.drain_seconds(name),
            )
            for name, pool in self._pools.items()
        }
        return ResidencyView(residents, demand)

    def _apply(self, now: float, decision: ResidencyDecision, out: list[Command]) -> None:
        if decision.sleep or decision.wake:
            self.version += 1
        for rid, level, reason in decision.sleep:
            r = self._replicas[rid]
            r.state, r.since, r.level, r.reason = Residency.DRAINING, now, level, reason
            if reason != "idle":
                self.counters.evictions += 1
            r.drain_from = now if r.busy else None
            if not r.busy:
                self._sleep(r, out)
        for rid in decision.wake:
            r = self._replicas[rid]
            r.state, r.since, r.wake_sent = Residency.WAKING, now, now
            out.append(Wake(r.pool, rid))
        self._next_at = decision.next_at

    def _sleep(self, r: _Replica, out: list[Command]) -> None:
        r.sleep_sent = True
        self.counters.sleeps += 1
        out.append(Sleep(r.pool, r.id, r.level, r.reason))

    def _rest(self, now: float, out: list[Command]) -> None:
        """Tell each pool whose resting replicas changed."""
        resting: dict[str, set[ReplicaId]] = {name: set() for name in self._pools}
        for r in self._replicas.values():
            if r.state is not Residency.SERVING:
                resting[r.pool].add(r.id)
        for name, ids in resting.items():
            frozen = frozenset(ids)
            if self._resting.get(name, frozenset()) != frozen:
                self._resting[name] = frozen
                out.extend(self._pools[name].rest(now, frozen))
