"""The pool controller: one model pool's control loop, sans I/O.

::

    pool = PoolController(settings)
    commands = pool.handle(now, event)     # Route · Reject · Probe · Ejected · Scale
    pool.next_wakeup()                     # hand it a Tick() then (or sooner, with news)

It owns every rule between the shells and the policies: which view the router and the
health policy see and when it is rebuilt, the request's walk through admission, routing
and retries, the counts those read (requests in flight, retries in flight, attempts per
replica, arrivals), restarts and probes, holds at an empty pool, and when the autoscaler
decides. It never sleeps, reads a clock or does I/O; the gateway and the simulator feed it
the same events and carry out the same commands.

A request's life (conserved: every ``Arrived`` ends in exactly one final command — a
``Reject``, or a ``Route`` whose attempt the shell ends with ``Finished``)::

    Arrived ─► admission ─┬─ starts now ─────────────────┐
                          └─ queued ─► admitted (pump) ───┤        (or Reject: shed, expired)
                                                          ▼
               rank ─► Route(first candidate) ◄─── held while the pool has no routable
                          │                          replica but one is on its way (starting,
                          │                          or an autoscaled pool; Reject on timeout)
           AttemptFailed ─┼─► Route(next candidate, retry)  before the first byte: within
                          │                          max_retries; from the retry budget
                          │                          unless the replica is gone
                          ├─► Route(another replica, resume) after it: resumable, within
                          │                                  max_resumes and resume_within
                          └─► Reject(exhausted | broken)
           Finished ──────► leaves: admission pumps the queue

    Preempting(replica, at) ─► the replica takes no new attempt (shown DRAINING)
           at − abandon_before ─► Abandon(its attempts) ─► each resumes or retries elsewhere
                                   (free: the replica is going); a new process ends it

    Reclaimed(replica) ─► Replace(replica, spot | on_demand) or wait for spot GPUs
    SpotMarket(available) ─► Replace(the waiting ones, the stand-ins; spot)  (control/_spot.py)

    a batch line (spare.recall): Route ─► an interactive request takes a replica's last slot
           ─► Recall(the newest line there) ─► AttemptFailed ─► waits at the gate again
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, count
from random import Random
from typing import Any, Final

from gpufleet.control._adapters import PoolAdapters
from gpufleet.control._events import (
    Abandon,
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Ejected,
    Event,
    Finished,
    KvEvents,
    KvResync,
    Preempting,
    Probe,
    ProbeAnswered,
    Recall,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Route,
    Scale,
    Scraped,
    Standbys,
    Tick,
    UnloadAdapter,
)
from gpufleet.control._settings import PoolSettings
from gpufleet.control._spot import SpotCapacity
from gpufleet.control._spot_events import Reclaimed, SpotMarket
from gpufleet.fleet import (
    NO_LOAD,
    FleetView,
    Outcome,
    ProbeResult,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    RouteRequest,
)
from gpufleet.policy import (
    BATCH,
    AutoscalePolicy,
    HealthDecision,
    HealthPolicy,
    PoolAdmission,
    PoolView,
    PrecisePrefixRouter,
    Router,
    ScaleDecision,
    SpareCapacity,
    SpareView,
    Standby,
    Ticket,
    make_router,
    retry_allowed,
)

ANONYMOUS: Final = "anonymous"
"""The tenant of a request that names none."""
_LEAVING: Final = frozenset({ReplicaState.DRAINING, ReplicaState.STOPPED})
"""Runtime states of a replica that takes no new attempt (a retry included)."""
_DEAD: Final = frozenset({ReplicaState.FAILED, ReplicaState.STOPPED})
"""Runtime states of a replica whose process is gone (crashed, or stopped)."""
_OUT: Final = frozenset({ReplicaState.EJECTED, ReplicaState.FAILED})
"""Routing states of a replica health has taken out (ejected, or failing its checks)."""
_QUEUED, _HELD, _ROUTED, _GATED, _RECALLED = 0, 1, 2, 3, 4
_DONE: Final = float("inf")
"""A noticed replica whose attempts were abandoned already."""


class _Request:
    """A request the pool knows, from its arrival until it leaves (a plain class: one is
    made per request, on the hot path)."""

    __slots__ = (
        "arrived_at",
        "batch",
        "beside",
        "candidates",
        "engine_priority",
        "hold_until",
        "loaded",
        "phase",
        "recallable",
        "replica",
        "request",
        "resumable",
        "resumes",
        "retry",
        "ticket",
        "tried",
    )

    def __init__(
        self,
        request: RouteRequest,
        ticket: Ticket | None,
        now: float,
        resumable: bool,
        recallable: bool = False,
    ) -> None:
        self.request = request
        self.ticket = ticket
        self.arrived_at = now
        self.resumable = resumable
        self.recallable = recallable
        """Its answer comes whole: an attempt may be stopped and run again (a recall)."""
        self.resumes = 0
        """Times its stream was resumed on another replica."""
        self.phase = _QUEUED
        self.batch = False
        """It passed the spare-capacity gate (counted in ``batch_in_flight`` until it ends)."""
        self.beside = False
        """An interactive request that arrived while batch lines ran (the TTFT guard)."""
        self.replica: ReplicaId | None = None
        self.candidates: list[ReplicaId] = []
        """Where a retry may go next, best first."""
        self.retry = False
        """Its attempt in flight is a retry drawn from the budget (in ``active_retries``)."""
        self.hold_until = 0.0
        self.tried: list[ReplicaId] | None = None
        """The replicas whose attempts failed (made at the first failure)."""
        self.loaded = False
        """Its attempt in flight loads its LoRA adapter first (its Route's ``load``)."""
        self.engine_priority = 0
        """The request priority its engines get (its Routes' ``priority``)."""


@dataclass(slots=True)
class PoolCounters:
    """What the pool did, counted (both shells report these)."""

    arrived: int = 0
    routed: int = 0
    """Rankings asked for."""
    matched_blocks: int = 0
    """Prefix blocks the router believed cached on the replicas it picked."""
    retries: int = 0
    free_retries: int = 0
    """Retries of an attempt whose replica was gone (not drawn from the budget)."""
    retries_refused: int = 0
    rejected: int = 0
    no_replica: int = 0
    """Requests no replica could take (none routable, or every candidate failed)."""
    broken: int = 0
    """Streams that broke after their first byte and were not resumed."""
    resumes: int = 0
    """Streams that broke after their first byte and were resumed on another replica."""
    shed: int = 0
    expired: int = 0
    held: int = 0
    hold_served: int = 0
    """Held requests routed once a replica became routable."""
    hold_timeouts: int = 0
    gated: int = 0
    """Batch requests that waited at the spare-capacity gate."""
    gate_expired: int = 0
    """Batch requests refused at the gate: no room before their deadline."""
    recalled: int = 0
    """Batch lines whose attempt was stopped for an interactive request (back to the gate)."""


class PoolController:
    """One model pool's control loop. See the module docstring."""

    def __init__(self, settings: PoolSettings) -> None:  # noqa: PLR0915 - a field a line
        self.settings = settings
        self.model = settings.model
        seed, i = settings.seed, settings.index
        self.router: Router = make_router(settings.routing, Random(seed * 1000 + 2 * i))
        self._kv = self.router if isinstance(self.router, PrecisePrefixRouter) else None
        """The router, when it reads the engines' KV events (``prefix_precise``)."""
        self.health = HealthPolicy(settings.health, Random(seed * 1000 + 2 * i + 1))
        self.admission = (
            None
            if settings.admission is None
            else PoolAdmission(settings.admission, settings.max_num_seqs)
        )
        self.autoscaler = (
            None
            if settings.autoscale is None
            else AutoscalePolicy(settings.autoscale, settings.max_num_seqs)
        )
        self.adapters = None if settings.lora is None else PoolAdapters(settings.lora)
        """Its LoRA adapters on its replicas (``None``: it serves none)."""
        self.spare = None if settings.spare is None else SpareCapacity(settings.spare)
        """The gate of the batch class (docs/batch.md, "Spare capacity")."""
        self._guard = None if self.spare is None else self.spare.guard
        """Its TTFT guard, told each interactive request's TTFT (``None``: none asked)."""
        self.batch_in_flight = 0
        """Batch requests let through the gate and not yet ended."""
        self._recalls = settings.spare is not None and settings.spare.recall
        self._batch_on: dict[ReplicaId, dict[str, _Request]] = {}
        """The recallable batch lines' attempts in flight per replica, oldest first (with
        ``spare.recall``): what an interactive request that finds a replica full may recall."""
        self.counters = PoolCounters()
        self.view = FleetView.of(0.0, ())
        """What the router reads: runtime states after health, last scraped loads."""
        self.decision: HealthDecision | None = None
        self.last_scale: ScaleDecision | None = None
        self.in_flight = 0
        """Requests admitted and not yet ended (held ones too): the retry budget's base."""
        self.active_retries = 0
        """Retries in flight drawn from the budget (a gone replica's retries are not)."""
        self.attempts: dict[ReplicaId, int] = {}
        """Attempts in flight per replica: the autoscaler's in-flight count."""
        self.standbys: tuple[Standby, ...] = ()
        self.spot = SpotCapacity(settings.model, settings.capacity, settings.spot_fallback)
        """Where its reclaimed replicas go: spot, on-demand, or waiting (docs/spot.md)."""
        self._seen: dict[ReplicaId, ReplicaSeen] = {}
        self._loads: dict[ReplicaId, ReplicaLoad] = {}
        self._views: dict[ReplicaId, ReplicaView] = {}
        self._restarted: set[ReplicaId] = set()
        self._failing: frozenset[ReplicaId] = frozenset()
        """Replicas the last health decision had failing their active checks."""
        self._requests: dict[str, _Request] = {}
        self._queued: dict[str, _Request] = {}
        self._held: dict[str, _Request] = {}
        self._gated: dict[str, _Request] = {}
        """Batch requests waiting at the gate, oldest first (their tickets hold deadlines)."""
        self._gate_deadlines: list[tuple[float, int, str]] = []
        """The gated requests' deadlines, a heap of (deadline, arrival order, id) whose
        entries of requests let through already are dropped as they surface: a batch job's
        many thousand lines cost a look at the top, not a scan."""
        self._gate_order = count()
        self._gate_at: float | None = None
        """When the gate wants a look: its limit may grow, or a waiting deadline passes."""
        self._health_at: float | None = None
        self._queue_at: float | None = None
        self._scale_start: float | None = None
        self._scale_count = 0
        self._scale_wake: float | None = None
        self._scale_last: float | None = None
        self._scale_arrivals = 0
        self._reachable: frozenset[ReplicaId] = frozenset()
        """Replicas an attempt can go to: the runtime has a process for it, not leaving, and
        its model is resident."""
        self._leaving: dict[ReplicaId, float] = {}
        """Replicas under a preemption notice, and when their attempts are abandoned (the
        notice's deadline less ``abandon_before``; ``inf`` once done)."""
        self._leave_at: float | None = None
        """The earliest of those still to come."""
        self.resting: frozenset[ReplicaId] = frozenset()
        """Replicas whose model is not resident (asleep, waking, draining to sleep): set by
        the residency controller (``control/_residency.py``) through :meth:`rest`."""
        self._tries = 1 + settings.retry.max_retries
        # one dict lookup per event, not a chain of isinstance checks (the hot path)
        handlers: dict[type, Callable[[float, Any, list[Command]], None]] = {
            Arrived: self._arrived,
            Finished: self._finished,
            AttemptFailed: self._attempt_failed,
            ClientGone: self._client_gone,
            Replicas: self._replicas,
            Scraped: self._scraped,
            ProbeAnswered: self._probe_answered,
            Standbys: self._standbys,
            Tick: self._tick,
            KvEvents: self._kv_events,
            Preempting: self._preempting,
            Reclaimed: self._reclaimed,
            SpotMarket: self._spot_market,
        }
        self._on = handlers

    # -- the one entry point -------------------------------------------------------------

    def handle(self, now: float, event: Event) -> list[Command]:
        """Take ``event`` at ``now``; the commands to carry out, in order."""
        out: list[Command] = []
        try:
            on = self._on[type(event)]
        except KeyError:
            raise TypeError(f"not an event: {event!r}") from None
        on(now, event, out)
        return out

    def _finished(self, now: float, event: Finished, out: list[Command]) -> None:
        req = self._requests.get(event.request_id)
        if req is None:
            return
        if req.phase == _ROUTED:
            if event.ttft is not None and self._guard is not None and not req.batch:
                self._guard.observe(now, event.ttft, req.beside)
            decide = self._end_attempt(now, req, event.outcome)
            self._done(now, req, event.work, out)
            if decide:
                self._decide_health(now, out)
            if self._held and self.adapters is not None:
                self._slot_freed(now, out)
        elif req.phase == _RECALLED:  # answered before the recall reached it: it is done
            del self._requests[event.request_id]

    def _attempt_failed(self, now: float, event: AttemptFailed, out: list[Command]) -> None:
        req = self._requests.get(event.request_id)
        if req is None:
            return
        if req.phase == _ROUTED:
            self._failed(now, req, event.outcome, event.streamed, out)
        elif req.phase == _RECALLED:  # the recall ended its attempt: it waits at the gate
            self._regate(now, req, out)

    def _client_gone(self, now: float, event: ClientGone, out: list[Command]) -> None:
        self._gone(now, event.request_id, out)
        if self._held and self.adapters is not None:
            self._slot_freed(now, out)  # its attempt may have held an adapter's last slot

    def _scraped(self, now: float, event: Scraped, out: list[Command]) -> None:
        for x in event.loads:
            if x.replica in self._seen:
                self._loads[x.replica] = ReplicaLoad(
                    running=x.running,
                    waiting=x.waiting,
                    kv_cache_usage=min(1.0, x.kv_cache_usage),
                    observed_at=now,
                )
        self._refresh(now, out)

    def _probe_answered(self, now: float, event: ProbeAnswered, out: list[Command]) -> None:
        replica = event.replica
        if replica in self._seen and self.health.on_event(now, ProbeResult(replica, event.ok)):
            self._decide_health(now, out)

    def _standbys(self, now: float, event: Standbys, out: list[Command]) -> None:
        self.standbys = event.standbys

    def _kv_events(self, now: float, event: KvEvents, out: list[Command]) -> None:
        """An engine's KV-event batches, for the router that reads them; a batch of
        another process than the replica's current one is dropped (docs/kv-events.md)."""
        kv, replica = self._kv, event.replica
        seen = self._seen.get(replica)
        if kv is None or seen is None or seen.incarnation != event.incarnation:
            return
        ask = kv.on_kv_events(now, replica, event.incarnation, event.batches, event.replay)
        if ask is not None:
            out.append(KvResync(self.model, replica, ask))

    def _preempting(self, now: float, event: Preempting, out: list[Command]) -> None:
        """A preemption notice: no new attempt there from now on, and its attempts ended
        ``abandon_before`` ahead of the deadline (docs/spot.md)."""
        replica = event.replica
        seen = self._seen.get(replica)
        if seen is None or seen.incarnation is None or seen.state in _DEAD:
            return  # not a process of ours now: nothing to drain
        at, old = event.at - self.settings.abandon_before, self._leaving.get(replica)
        if old is not None and (old <= at or old == _DONE):
            return  # told again (a taint seen twice), or done: the first notice holds
        self._leaving[replica] = at
        self._reachable = self._reach()
        self._refresh(now, out)
        self._preempt_due(now, out)

    def _reclaimed(self, now: float, event: Reclaimed, out: list[Command]) -> None:
        """The provider took the replica's GPUs: a new node, spot or on-demand, or a wait."""
        out += self.spot.reclaimed(event.replica)

    def _spot_market(self, now: float, event: SpotMarket, out: list[Command]) -> None:
        out += self.spot.market(event.available)

    def _preempt_due(self, now: float, out: list[Command]) -> None:
        """Abandon the attempts on each noticed replica whose time has come; set the next."""
        due = None
        for replica, at in self._leaving.items():
            if at <= now:
                self._leaving[replica] = _DONE
                ids = self._attempts_on(replica)
                if ids:
                    out.append(Abandon(self.model, replica, ids))
            elif due is None or at < due:
                due = at
        self._leave_at = due

    def _attempts_on(self, replica: ReplicaId) -> tuple[str, ...]:
        """The requests with an attempt in flight on ``replica``."""
        if not self.attempts.get(replica):
            return ()
        return tuple(
            rid
            for rid, req in self._requests.items()
            if req.phase == _ROUTED and req.replica == replica
        )

    def next_wakeup(self) -> float | None:
        """The earliest time something falls due (a health decision, the queue's tick, a
        held request's deadline, an autoscaling decision); ``None``: nothing."""
        # no list, no min(): the gateway asks after every event
        due = self._health_at
        queue = self._queue_at
        if queue is not None and (due is None or queue < due):
            due = queue
        if self._held:
            held = next(iter(self._held.values())).hold_until
            if due is None or held < due:
                due = held
        gate = self._gate_at
        if gate is not None and (due is None or gate < due):
            due = gate
        leave = self._leave_at
        if leave is not None and (due is None or leave < due):
            due = leave
        if self.autoscaler is not None:
            scale = self._scale_due()
            if due is None or scale < due:
                due = scale
        return due

    # -- questions ------------------------------------------------------------------------

    def routable(self) -> tuple[ReplicaView, ...]:
        return self.view.routable(self.model)

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def held_since(self) -> float | None:
        """When the oldest request held now arrived (``None``: none is held)."""
        for req in self._held.values():  # in the order they were held
            return req.arrived_at
        return None

    def pool_view(self, demand: float = 0.0) -> PoolView:
        """The pool as the autoscaler sees it: the routing view with this controller's
        attempts in flight per replica, the standbys, the held requests."""
        attempts = self.attempts
        return PoolView.of(
            self.view,
            self.model,
            in_flight=lambda r: attempts.get(r, 0),
            demand=demand,
            standbys=self.standbys,
            held=len(self._held),
        )

    # -- the runtime's picture ------------------------------------------------------------

    def _replicas(self, now: float, event: Replicas, out: list[Command]) -> None:
        replicas = event.replicas
        old = self._seen
        fresh = {r.id: r for r in replicas}
        checked: list[ReplicaId] = []
        for r in replicas:
            was = old.get(r.id)
            new_process = r.incarnation is not None and (
                was is None or was.incarnation != r.incarnation
            )
            if new_process:
                self._restarted.add(r.id)  # a new process: its checks start over
                if self._leaving:
                    self._leaving.pop(r.id, None)  # a new node: the notice was the old one's
            if was is not None and was.incarnation != r.incarnation:
                if self._kv is not None:
                    self._kv.restarted(r.id, r.incarnation)  # its cache is gone with its process
                if self.adapters is not None:
                    self.adapters.forget(r.id)  # and its adapters
            if (
                r.state is ReplicaState.READY
                and r.incarnation is not None
                and (was is None or new_process or was.state is not ReplicaState.READY)
            ):
                checked.append(r.id)  # the runtime just saw this process answer /health
        for gone in old.keys() - fresh.keys():
            self._leaving.pop(gone, None)
            self.spot.forget(gone)
            if self.adapters is not None:
                self.adapters.forget(gone)
            if self._kv is not None:
                self._kv.forget(gone)
            self._loads.pop(gone, None)
            self._views.pop(gone, None)
            self._restarted.discard(gone)
        self._seen = fresh
        self._reachable = self._reach()
        restarted = bool(self._restarted)
        self._decide_health(now, out)
        for replica in checked:
            # the runtime reports READY only after its own health check passed: that is the
            # process's first passing check (the reset above came first), so a replica the
            # runtime has seen healthy is routable at once; active checks go on from here
            self.health.on_event(now, ProbeResult(replica, True))
        if restarted or checked:
            self._decide_health(now, out)  # the new process's first probe, at once

    def _reach(self) -> frozenset[ReplicaId]:
        reach = frozenset(
            r.id
            for r in self._seen.values()
            if r.incarnation is not None and r.state not in _LEAVING
        )
        if self._leaving:
            reach -= self._leaving.keys()
        return reach - self.resting if self.resting else reach

    def rest(self, now: float, resting: frozenset[ReplicaId]) -> list[Command]:
        """Keep ``resting`` replicas out of routing (their model is not resident): the view
        shows them ``STARTING``, so a request that finds no other waits for one, held as
        for a replica being started; the others become routable (and take the held
        requests). The residency controller's call; the commands it gives."""
        out: list[Command] = []
        self.resting = resting
        self._reachable = self._reach()
        self._refresh(now, out)
        return out

    def _runtime_state(self, seen: ReplicaSeen) -> ReplicaState:
        return ReplicaState.STARTING if seen.incarnation is None else seen.state

    def _decide_health(self, now: float, out: list[Command]) -> None:
        members = []
        for rid, seen in self._seen.items():
            state = self._runtime_state(seen)
            if rid in self._restarted and state is ReplicaState.READY:
                state = ReplicaState.STARTING  # the first decision after a restart resets it
            members.append(ReplicaView(rid, self.model, state))
        self._restarted.clear()
        decision = self.health.decide(now, FleetView(now, {self.model: tuple(members)}))
        self.decision = decision
        self._health_at = decision.next_at
        out.extend(Ejected(record) for record in decision.ejections)
        out.extend(Probe(self.model, replica) for replica in decision.probes)
        self._abandon(decision, out)
        self._refresh(now, out)

    def _abandon(self, decision: HealthDecision, out: list[Command]) -> None:
        """The attempts in flight on each replica that has just failed its active checks:
        an :class:`Abandon` for them (``health.active.abandon``). Once per failure: a
        replica failing its checks takes no new attempt (but in panic)."""
        failed = frozenset(r for r, s in decision.states.items() if s is ReplicaState.FAILED)
        newly, self._failing = failed - self._failing, failed
        if not newly or not self.attempts.keys() & newly:
            return
        if not self.settings.health.active.abandon:
            return
        for replica in (r for r in self._seen if r in newly and self.attempts.get(r)):
            out.append(Abandon(self.model, replica, self._attempts_on(replica)))

    def _refresh(self, now: float, out: list[Command]) -> None:
        """Rebuild the routing view (a replica's view object kept while it is unchanged:
        routers key caches on a pool's identity); route held requests if it has room."""
        decided = None if self.decision is None else self.decision.states
        views, loads, resting, leaving = self._views, self._loads, self.resting, self._leaving
        current: list[ReplicaView] = []
        for rid, seen in self._seen.items():
            state = self._runtime_state(seen)
            if leaving and rid in leaving and state is not ReplicaState.STOPPED:
                state = ReplicaState.DRAINING  # noticed: it leaves, whatever health says
            if state is ReplicaState.READY:
                state = (decided.get(rid) if decided is not None else None) or (
                    ReplicaState.STARTING
                )
                if resting and state is ReplicaState.READY and rid in resting:
                    state = ReplicaState.STARTING  # its model sleeps (or is on its way)
            load = loads.get(rid, NO_LOAD)
            view = views.get(rid)
            if view is None or view.state is not state or view.load is not load:
                view = views[rid] = ReplicaView(rid, self.model, state, load)
            current.append(view)
        self.view = FleetView(now, {self.model: tuple(current)} if current else {})
        if self._held and self.view.routable(self.model):
            for req in list(self._held.values()):
                del self._held[req.request.request_id]
                self._route(now, req, out)
        if self._gated:
            self._release(now, out)  # a scrape, health, or replicas came or went

    # -- requests -------------------------------------------------------------------------

    def _arrived(self, now: float, event: Arrived, out: list[Command]) -> None:
        request = event.request
        self.counters.arrived += 1
        if request.adapter is not None and self.adapters is not None:
            self.adapters.arrived(now, request.adapter)
        self._scale_arrivals += 1
        admission = self.admission
        if self.spare is not None and event.priority == BATCH:
            self._gate(now, event, out)
            return
        if admission is None:
            req = _Request(request, None, now, event.resumable, event.recallable)
            req.engine_priority = self._engine_priority(event.priority)
            req.beside = self.batch_in_flight > 0
            self._requests[request.request_id] = req
            self.in_flight += 1
            self._route(now, req, out)
            return
        deadline = event.deadline if event.deadline is not None else now + admission.config.max_wait
        ticket = Ticket(
            request.request_id,
            request.tenant or ANONYMOUS,
            event.priority,
            event.weight,
            request.prompt_tokens,
            deadline,
            now,
        )
        req = _Request(request, ticket, now, event.resumable, event.recallable)
        req.engine_priority = self._engine_priority(event.priority)
        req.beside = self.batch_in_flight > 0
        self._requests[request.request_id] = req
        self._enter(now, req, ticket, out)

    def _enter(self, now: float, req: _Request, ticket: Ticket, out: list[Command]) -> None:
        """Admission for a request with a ticket: it starts now, or waits in the queue."""
        admission = self.admission
        assert admission is not None
        if admission.enter(ticket, self.routable()):
            self.in_flight += 1
            self._route(now, req, out)
            return
        self._queued[ticket.id] = req
        for shed in admission.offer(now, ticket):
            self.counters.shed += 1
            self._reject(self._queued.pop(shed.id), RejectReason.SHED, out)
        if (
            self._batch_on
            and ticket.priority < BATCH
            and ticket.id in self._queued
            and admission.saturated(self.routable())
        ):
            # the pool is full and batch lines hold part of it: one gives its slot back, and
            # the pump starts the best waiting request (the interactive class goes first)
            self._recall(now, max(self._batch_on, key=self.attempts.__getitem__), out)
        self._pump(now, out)
        if self._queue_at is None and self._queued:
            self._queue_at = now + admission.config.tick

    # -- the batch class's gate -------------------------------------------------------------

    def _gate(self, now: float, event: Arrived, out: list[Command]) -> None:
        """A batch request waits at the gate until the pool has room for it (or its deadline:
        its own, else the gate's ``max_wait``)."""
        spare = self.spare
        assert spare is not None
        request = event.request
        rid = request.request_id
        # let through, it enters admission with no deadline: it already waited here
        ticket = Ticket(
            rid, request.tenant or ANONYMOUS, BATCH, event.weight, request.prompt_tokens, None, now
        )
        req = _Request(request, ticket, now, event.resumable, event.recallable)
        req.engine_priority = self._engine_priority(BATCH)
        req.phase = _GATED
        wait = spare.config.max_wait
        req.hold_until = event.deadline if event.deadline is not None else now + wait
        self._requests[rid] = req
        self._gated[rid] = req
        heapq.heappush(self._gate_deadlines, (req.hold_until, next(self._gate_order), rid))
        self.counters.gated += 1
        self._release(now, out)

    def _release(self, now: float, out: list[Command]) -> None:
        """Let the batch requests the gate has room for through (oldest first), into
        admission (or straight to routing without it); then when to look again. (A line
        may start the instant any request ends, on any replica: the simulator runs no
        replica ahead of the fleet while a gate holds its batch tenants.)"""
        spare = self.spare
        assert spare is not None
        gated = self._gated
        decision = spare.decide(now, self._spare_view())
        for _ in range(min(decision.room, len(gated))):
            req = gated.pop(next(iter(gated)))
            req.phase, req.batch = _QUEUED, True
            self.batch_in_flight += 1
            ticket = req.ticket
            if self.admission is None or ticket is None:
                self.in_flight += 1
                self._route(now, req, out)
            else:
                self._enter(now, req, ticket, out)
        due = decision.next_at if gated else None
        first = self._first_deadline()
        if first is not None and (due is None or first < due):
            due = first
        self._gate_at = due

    def _engine_priority(self, priority: int) -> int:
        """The request priority a request of class ``priority`` gets at this pool's engines:
        a batch-class one ``BATCH`` (after interactive work, 0) where they schedule by
        priority; none elsewhere (vLLM refuses a priority under its default fcfs policy)."""
        return BATCH if priority >= BATCH and self.settings.by_priority else 0

    def _regate(self, now: float, req: _Request, out: list[Command]) -> None:
        """A recalled line's attempt ended: it waits at the gate again (at the back; until
        its own deadline, or ``max_wait`` from now if that is later: it is run again from its
        start when there is room)."""
        spare = self.spare
        assert spare is not None
        rid = req.request.request_id
        req.phase = _GATED
        req.hold_until = max(req.hold_until, now + spare.config.max_wait)
        self._gated[rid] = req
        heapq.heappush(self._gate_deadlines, (req.hold_until, next(self._gate_order), rid))
        self._release(now, out)

    def _recall(self, now: float, replica: ReplicaId, out: list[Command]) -> None:
        """An interactive attempt just took more than ``replica``'s slots: stop the newest
        batch line there (the one with the least work done), so the engine runs the
        interactive request at its next step instead of queueing it behind the batch.

        The line leaves the pool's counts now (its slot is the interactive request's); it
        waits at the gate again once the shell reports its attempt ended (``AttemptFailed``),
        or leaves if its answer came first (``Finished``)."""
        lines = self._batch_on[replica]
        req = lines[next(reversed(lines))]
        # CANCELLED moves no breaker: health has nothing to decide
        self._end_attempt(now, req, Outcome.CANCELLED)
        self.in_flight -= 1
        self.batch_in_flight -= 1
        req.batch = False
        if self.admission is not None and req.ticket is not None:
            self.admission.leave(req.ticket, None)
        req.phase = _RECALLED
        self.counters.recalled += 1
        out.append(Recall(self.model, replica, req.request.request_id))

    def _first_deadline(self) -> float | None:
        """The soonest deadline of a request still at the gate (the heap's stale tops go)."""
        heap, gated = self._gate_deadlines, self._gated
        while heap and heap[0][2] not in gated:
            heapq.heappop(heap)
        if not gated:
            heap.clear()
            return None
        return heap[0][0]

    def _spare_view(self) -> SpareView:
        routable = self.routable()
        return SpareView(
            replicas=len(routable),
            max_num_seqs=self.settings.max_num_seqs,
            in_flight=self.in_flight,
            batch_in_flight=self.batch_in_flight,
            batch_waiting=len(self._gated),
            gateway_waiting=len(self._queued) + len(self._held),
            loads=tuple(r.load for r in routable),
        )

    def _gate_tick(self, now: float, out: list[Command]) -> None:
        """Refuse the batch requests whose wait ran out; let through what fits."""
        heap, gated = self._gate_deadlines, self._gated
        due: list[tuple[int, str]] = []
        while heap and heap[0][0] <= now:
            _, order, rid = heapq.heappop(heap)
            if rid in gated:
                due.append((order, rid))
        for _, rid in sorted(due):  # in the order they came, as they waited
            req = gated.pop(rid)
            self.counters.gate_expired += 1
            self._reject(req, RejectReason.EXPIRED, out)
        if self._gated:
            self._release(now, out)
        else:
            self._gate_at = None

    @property
    def gated(self) -> int:
        """Batch requests waiting at the gate."""
        return len(self._gated)

    def _pump(self, now: float, out: list[Command]) -> None:
        admission = self.admission
        if admission is None or not self._queued:
            return
        routable = self.routable()
        while (ticket := admission.admit(now, routable)) is not None:
            req = self._queued.pop(ticket.id)
            self.in_flight += 1
            self._route(now, req, out)
            routable = self.routable()

    def _route(self, now: float, req: _Request, out: list[Command]) -> None:
        """Rank an admitted request and send it to its first candidate (or hold it, or
        refuse it)."""
        ranking = self.router.rank(now, req.request, self.view)
        self.counters.routed += 1
        tiers = ranking.tiers
        order = tiers[0] if len(tiers) == 1 else tuple(chain.from_iterable(tiers))
        adapter = req.request.adapter
        if adapter is not None and self.adapters is not None:
            candidates = self._adapter_candidates(now, adapter, order)
            if candidates is None:  # every adapter slot busy: it waits for one
                self._wait_for_slot(now, req, out)
                return
        else:
            candidates = list(filter(self._reachable.__contains__, order[: self._tries]))
        if not candidates:
            if not ranking.tiers and self.settings.hold_requests > 0 and self._coming():
                self._hold(now, req, out)
                return
            self.counters.no_replica += 1
            self._finish(req, RejectReason.NO_REPLICA, out)
            return
        replica = candidates.pop(0)
        matched = ranking.matched_blocks.get(replica, 0)
        self.counters.matched_blocks += matched
        held = req.phase == _HELD
        if held:
            self.counters.hold_served += 1
        req.candidates = candidates
        load = self._start(now, req, replica, out, retry=False)
        rid = req.request.request_id
        out.append(
            Route(
                rid,
                replica,
                False,
                ranking.policy,
                ranking.panic,
                matched,
                held,
                load=load,
                priority=req.engine_priority,
            )
        )

    def _adapter_candidates(
        self, now: float, adapter: str, order: Sequence[ReplicaId]
    ) -> list[ReplicaId] | None:
        """A LoRA adapter's request: the replica adapter placement picks among the reachable
        ones of the ranking (a holder, or where it loads). ``None``: none holds it and every
        slot of every one is busy (it waits; a pool that holds no request sends it over the
        best one's cap instead)."""
        adapters = self.adapters
        assert adapters is not None
        reach = list(filter(self._reachable.__contains__, order))
        if not reach:
            return []
        placed = adapters.place(now, adapter, reach, self.attempts)
        if placed is None:
            if self.settings.hold_requests > 0:
                return None
            first = reach[0]
        else:
            first = placed.replica
        return [first]  # a retry asks placement again (_placed), on a fresh ranking

    def _wait_for_slot(self, now: float, req: _Request, out: list[Command]) -> None:
        """Hold an adapter's request until an attempt ends and frees a slot (bounded as any
        held request: ``hold_requests``, ``hold_timeout``); one held already keeps its place
        and its deadline."""
        adapters = self.adapters
        assert adapters is not None
        if req.phase == _HELD:
            self._held[req.request.request_id] = req
            return
        adapters.counters.waits += 1
        self._hold(now, req, out)

    def _slot_freed(self, now: float, out: list[Command]) -> None:
        """An attempt ended: the adapters' requests held for a slot try again, in order."""
        waiting = [r for r in self._held.values() if r.request.adapter is not None]
        if not waiting:
            return
        for req in waiting:
            del self._held[req.request.request_id]
            self._route(now, req, out)  # routed, or back in _held (at the end)
        # the tick expires held requests from the front: keep them in deadline order
        self._held = dict(sorted(self._held.items(), key=lambda item: item[1].hold_until))

    def _coming(self) -> bool:
        """Whether a routable replica may be on its way: the pool is autoscaled (it scales
        from zero), or one of its replicas is starting (a process being launched or
        restarted, or up and not yet checked). Only then does a request wait for one."""
        if self.settings.holds:
            return True
        seen = self._seen
        return any(
            view.state is ReplicaState.STARTING and seen[view.id].state not in _LEAVING
            for view in self.view.replicas()
        )

    def _start(
        self, now: float, req: _Request, replica: ReplicaId, out: list[Command], *, retry: bool
    ) -> str:
        """An attempt starts on ``replica``; the adapter it loads there first (``""``: none;
        the adapters evicted to make room are unloaded first, into ``out``)."""
        req.phase, req.replica, req.retry = _ROUTED, replica, retry
        if retry:
            self.active_retries += 1
        attempts = self.attempts[replica] = self.attempts.get(replica, 0) + 1
        if self._recalls:
            if req.batch:
                if req.recallable:
                    self._batch_on.setdefault(replica, {})[req.request.request_id] = req
            elif attempts > self.settings.max_num_seqs and self._batch_on.get(replica):
                self._recall(now, replica, out)
        request = req.request
        self.router.on_request_start(now, request, replica)
        adapter = request.adapter
        if adapter is None or self.adapters is None:
            return ""
        load, evicted = self.adapters.start(now, replica, adapter)
        req.loaded = load
        out.extend(UnloadAdapter(self.model, replica, gone) for gone in evicted)
        return adapter if load else ""

    def _end_attempt(self, now: float, req: _Request, outcome: Outcome) -> bool:
        """The attempt in flight ended; whether health wants a decision now."""
        replica = req.replica
        assert replica is not None
        req.replica = None
        if req.retry:
            self.active_retries -= 1
            req.retry = False
        n = self.attempts[replica] - 1
        if n:
            self.attempts[replica] = n
        else:
            del self.attempts[replica]
        request = req.request
        if req.batch and self._recalls and req.recallable:
            lines = self._batch_on[replica]
            del lines[request.request_id]
            if not lines:
                del self._batch_on[replica]
        self.router.on_request_end(now, request, replica, outcome)
        if request.adapter is not None and self.adapters is not None:
            self.adapters.end(replica, request.adapter)
        if replica in self._seen:
            return self.health.finished(now, replica, outcome)
        return False

    def _failed(
        self, now: float, req: _Request, outcome: Outcome, streamed: bool, out: list[Command]
    ) -> None:
        """An attempt failed: retry on the next candidate (before the first byte; from the
        retry budget unless its replica is gone) or resume on another replica (after it),
        else the request ends in an error. Health decides after."""
        broken = req.replica
        if req.loaded and not streamed and self.adapters is not None and broken is not None:
            adapter = req.request.adapter
            assert adapter is not None
            self.adapters.forget_adapter(broken, adapter)  # its load may be what failed
        decide = self._end_attempt(now, req, outcome)
        if streamed:
            assert broken is not None
            self._resume(now, req, broken, out)
        else:
            self._retry(now, req, broken, outcome, out)
        if decide:
            self._decide_health(now, out)

    def _replica_gone(self, replica: ReplicaId, outcome: Outcome) -> bool:
        """Whether ``replica`` failed because it is gone rather than overloaded: the
        connection was refused or reset before an answer (``CONNECT_FAILURE``), the runtime
        says its process is gone, health has taken it out, or it is under a preemption
        notice. Retrying such a failure adds no load to a struggling replica, so it does
        not draw on the retry budget; a timeout or a 5xx from a replica still in service
        does (docs/design/retries.md)."""
        if outcome is Outcome.CONNECT_FAILURE or replica in self._leaving:
            return True
        seen = self._seen.get(replica)
        if seen is None or seen.incarnation is None or seen.state in _DEAD:
            return True
        view = self._views.get(replica)
        return view is not None and view.state in _OUT

    def _retry(
        self,
        now: float,
        req: _Request,
        failed: ReplicaId | None,
        outcome: Outcome,
        out: list[Command],
    ) -> None:
        """Send the request to a replica it has not tried, if it has retries left (at most
        ``max_retries``). A retry after a gone replica's failure is free; any other draws on
        the retry budget, and is refused when the budget is spent (docs/design/retries.md)."""
        assert failed is not None
        tried = req.tried
        if tried is None:
            tried = req.tried = [failed]
        else:
            tried.append(failed)
        replica, panic = self._next_candidate(now, req, tried)
        if replica is None:
            self.counters.no_replica += 1
            self._finish(req, RejectReason.EXHAUSTED, out)
            return
        free = self._replica_gone(failed, outcome)
        retry = self.settings.retry
        if not free and not retry_allowed(
            self.active_retries,
            self.in_flight,
            budget_percent=retry.budget_percent,
            min_retry_concurrency=retry.min_retry_concurrency,
        ):
            self.counters.retries_refused += 1
            self._finish(req, RejectReason.EXHAUSTED, out, budget=True)
            return
        self.counters.retries += 1
        if free:
            self.counters.free_retries += 1
        load = self._start(now, req, replica, out, retry=not free)
        rid = req.request.request_id
        priority = req.engine_priority
        out.append(Route(rid, replica, True, "", panic, 0, load=load, priority=priority))

    def _next_candidate(
        self, now: float, req: _Request, tried: list[ReplicaId]
    ) -> tuple[ReplicaId | None, bool]:
        """The next candidate of the request's ranking that is still reachable and that
        health has not taken out since the ranking was made; when those are used up, the
        best reachable replica of a new ranking that it has not tried. ``None``: none, or no
        retry left (``1 + max_retries`` attempts in all, each on another replica). With it,
        whether the new ranking was a panic one (every replica, ejected ones too)."""
        reachable, views = self._reachable, self._views
        while req.candidates:
            replica = req.candidates.pop(0)
            view = views.get(replica)
            if replica in reachable and (view is None or view.state not in _OUT):
                return replica, False
        if len(tried) >= self._tries:
            return None, False
        ranking = self.router.rank(now, req.request, self.view)
        self.counters.routed += 1
        options = [
            r for r in chain.from_iterable(ranking.tiers) if r in reachable and r not in tried
        ]
        if not options:
            return None, False
        return self._placed(now, req, options), ranking.panic

    def _placed(self, now: float, req: _Request, options: list[ReplicaId]) -> ReplicaId:
        """The first of ``options`` (a fresh ranking, reachable ones), or for a LoRA
        adapter's retry or resume where adapter placement puts it (a holder, first)."""
        adapter, adapters = req.request.adapter, self.adapters
        if adapter is None or adapters is None:
            return options[0]
        placed = adapters.place(now, adapter, options, self.attempts)
        return options[0] if placed is None else placed.replica

    def _resume(self, now: float, req: _Request, broken: ReplicaId, out: list[Command]) -> None:
        """A stream broke after its first byte: continue it on the best reachable replica of
        a fresh ranking other than ``broken`` (a resumable request, at most ``max_resumes``
        times, within ``resume_within`` of its arrival; no retry budget: the client is
        mid-answer, and resumes are bounded per request), else it ends in an error event."""
        retry = self.settings.retry
        if (
            req.resumable
            and req.resumes < retry.max_resumes
            and now - req.arrived_at <= retry.resume_within
        ):
            ranking = self.router.rank(now, req.request, self.view)
            reachable = self._reachable
            options = [
                r for r in chain.from_iterable(ranking.tiers) if r != broken and r in reachable
            ]
            if options:
                replica = self._placed(now, req, options)
                req.resumes += 1
                self.counters.resumes += 1
                req.candidates = []
                load = self._start(now, req, replica, out, retry=False)
                rid = req.request.request_id
                policy, panic = ranking.policy, ranking.panic
                out.append(
                    Route(
                        rid,
                        replica,
                        False,
                        policy,
                        panic,
                        resume=True,
                        load=load,
                        priority=req.engine_priority,
                    )
                )
                return
        self.counters.broken += 1
        self._finish(req, RejectReason.BROKEN, out)

    def _hold(self, now: float, req: _Request, out: list[Command]) -> None:
        settings = self.settings
        if len(self._held) >= settings.hold_requests:
            self._finish(req, RejectReason.HOLD_FULL, out)
            return
        req.phase = _HELD
        req.hold_until = now + settings.hold_timeout
        self._held[req.request.request_id] = req
        self.counters.held += 1
        if len(self._held) == 1 and self.autoscaler is not None:
            self._scale(now, out)  # a pool at zero cold-starts now, not at the next tick

    def _gone(self, now: float, rid: str, out: list[Command]) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        if req.phase == _ROUTED:
            decide = self._end_attempt(now, req, Outcome.CANCELLED)
            self._done(now, req, None, out)
            if decide:
                self._decide_health(now, out)
            return
        if req.phase == _HELD:
            del self._held[rid]
            self._done(now, req, None, out)
            return
        if req.phase == _GATED:
            del self._requests[rid]
            del self._gated[rid]
            return
        if req.phase == _RECALLED:
            del self._requests[rid]
            return
        del self._requests[rid]
        del self._queued[rid]
        if self.admission is not None and req.ticket is not None:
            self.admission.discard(req.ticket)
        if req.batch:  # a line let through the gate, waiting in admission: its room frees
            self.batch_in_flight -= 1
            if self._gated:
                self._release(now, out)

    def _finish(
        self, req: _Request, reason: str, out: list[Command], *, budget: bool = False
    ) -> None:
        """An admitted request ends without an answer: it leaves, then a Reject."""
        self.counters.rejected += 1
        self._leave(req, None)
        out.append(Reject(req.request.request_id, reason, budget))

    def _reject(self, req: _Request, reason: str, out: list[Command]) -> None:
        """A queued request is refused (never admitted)."""
        self.counters.rejected += 1
        del self._requests[req.request.request_id]
        if req.batch:
            self.batch_in_flight -= 1
        out.append(Reject(req.request.request_id, reason))

    def _done(
        self, now: float, req: _Request, work: tuple[int, int] | None, out: list[Command]
    ) -> None:
        self._leave(req, work)
        if self._queued:
            self._pump(now, out)
        if self._gated:
            self._release(now, out)  # room, maybe: a request left

    def _leave(self, req: _Request, work: tuple[int, int] | None) -> None:
        del self._requests[req.request.request_id]
        self.in_flight -= 1
        if req.batch:
            self.batch_in_flight -= 1
        if self.admission is not None and req.ticket is not None:
            self.admission.leave(req.ticket, work)

    # -- time -----------------------------------------------------------------------------

    def _tick(self, now: float, _: Tick, out: list[Command]) -> None:
        if self._health_at is not None and now >= self._health_at:
            self._decide_health(now, out)
        while self._held:
            req = next(iter(self._held.values()))
            if req.hold_until > now:
                break
            del self._held[req.request.request_id]
            self.counters.hold_timeouts += 1
            self._finish(req, RejectReason.HOLD_TIMEOUT, out)
        if self._queue_at is not None and now >= self._queue_at:
            self._queue_tick(now, out)
        if self._gate_at is not None and now >= self._gate_at:
            self._gate_tick(now, out)
        if self._leave_at is not None and now >= self._leave_at:
            self._preempt_due(now, out)
        if self.autoscaler is not None and now >= self._scale_due():
            self._scale(now, out)

    def _queue_tick(self, now: float, out: list[Command]) -> None:
        admission = self.admission
        assert admission is not None
        for ticket in admission.expire(now):
            self.counters.expired += 1
            self._reject(self._queued.pop(ticket.id), RejectReason.EXPIRED, out)
        self._pump(now, out)
        self._queue_at = now + admission.config.tick if self._queued else None

    def _scale_due(self) -> float:
        """The next autoscaling decision: every ``interval`` from the first, or sooner at
        the last decision's ``next_at``."""
        if self._scale_start is None:
            return float("-inf")
        periodic = self._scale_start + self._scale_count * self.settings.autoscale_interval
        wake = self._scale_wake
        return periodic if wake is None else min(periodic, wake)

    def _scale(self, now: float, out: list[Command]) -> None:
        policy = self.autoscaler
        assert policy is not None
        interval = self.settings.autoscale_interval
        if self._scale_start is None:
            self._scale_start = now
        while self._scale_start + self._scale_count * interval <= now:
            self._scale_count += 1
        if self._scale_wake is not None and self._scale_wake <= now:
            self._scale_wake = None
        span = None if self._scale_last is None else now - self._scale_last
        demand = self._scale_arrivals / span if span else 0.0
        if span is None or span > 0:
            self._scale_last, self._scale_arrivals = now, 0
        view = self.pool_view(demand)
        decision = policy.decide(now, view)
        self.last_scale = decision
        nxt = decision.next_at
        if nxt is not None and now < nxt and (self._scale_wake is None or nxt < self._scale_wake):
            self._scale_wake = nxt
        out.append(Scale(decision, view, self.spot.buy()))
