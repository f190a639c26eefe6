"""The gateway's side of the control loop: events in, commands carried out.

The rules are the pool controllers' (``gpufleet.control``, the simulator's too); this shell
turns what happens on the event loop into their events and does what they answer::

    replica source ──► Replicas        probe task ──► ProbeAnswered     one timer at
                   ──► Preempting      actuator   ──► Standbys          next_wakeup() ──► Tick
    scrape loop    ──► Scraped         (a replica's reclaim_at: a node's termination notice)
    a request      ──► Arrived · AttemptFailed · Finished · ClientGone
                                   │
    PoolController.handle(now, event)
                                   ▼
    Route / Reject ──► the waiting request     Probe  ──► a probe task
    Ejected        ──► metrics                 Scale  ──► the actuator (ScaleExecutor)
    Fallback       ──► metrics                 RolloutStep ──► on_rollout (_rollouts.py)
    a request's latencies on a pool a rollout watches ──► Latencies, before each Tick

A request's own decision usually comes back from its own event (it starts, or is refused,
at once); one that waits in the admission queue or the hold (or, after a fallback, in the
next pool's) gets a future that a later event's commands resolve. A request names its
served name; the controller chooses its pool (a Route's ``model``) and moves it on.
``record`` writes every event and its commands as JSON lines (``gpufleet up --record``),
which ``gpufleet replay`` feeds to a fresh controller.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import IO, Final

from gpufleet.config import FleetConfig
from gpufleet.control import (
    Abandon,
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Ejected,
    Event,
    Fallback,
    Finished,
    FleetController,
    KvResync,
    Latencies,
    PoolController,
    Preempting,
    Probe,
    ProbeAnswered,
    Recall,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Resident,
    RolloutStep,
    Route,
    Scale,
    Scraped,
    ScrapedLoad,
    Sleep,
    Standbys,
    Tick,
    UnloadAdapter,
    Wake,
)
from gpufleet.fleet import FleetView, Outcome, ReplicaId, RouteRequest
from gpufleet.gateway._adapters import AdapterShell
from gpufleet.gateway._autoscale import ScaleExecutor
from gpufleet.gateway._errors import GatewayError, NoReplicaError, UpstreamError
from gpufleet.gateway._kv_events import KvFeeds
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.gateway._replicas import Upstream
from gpufleet.gateway._residency import ResidencyMetrics, ResidencyShell
from gpufleet.gateway._scrape import parse_engine_metrics
from gpufleet.gateway._tenancy_errors import AdmissionError
from gpufleet.gateway._timeline import Timeline
from gpufleet.gateway._upstream import ReplicaClient
from gpufleet.gateway._views import ViewExport

logger = logging.getLogger("gpufleet.gateway")

Decision = Route | Reject
_DECISIONS: Final = (Route, Reject)
_FLUSH_EVERY: Final = 1.0
"""Seconds between two flushes of a recording, at most (on the timer's ticks)."""
_RETRY_TICK: Final = 1.0
"""Seconds until the timer tries again after a controller error (logged)."""


class LiveControl:
    """Every pool's controller, driven by the gateway's event loop."""

    def __init__(
        self,
        config: FleetConfig,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float],
        admission: bool,
        scaling: ScaleExecutor | None = None,
        on_gone: Callable[[Upstream], None] | None = None,
        wall: Callable[[], float] = time.time,
        prefill_s: Mapping[str, float] | None = None,
    ) -> None:
        self.config = config
        self.control = FleetController.of(
            config, admission=admission, autoscale=scaling is not None, prefill_s=prefill_s
        )
        self.pools: dict[str, PoolController] = self.control.pools
        self.upstreams: dict[ReplicaId, Upstream] = {}
        self.metrics = metrics
        self.scaling = scaling
        self.views = ViewExport(config, metrics)
        self.timeline = Timeline(clock, wall)
        """Ejections and acting scale decisions, for the console (``/admin/events``)."""
        self._models = {m.name: m for m in config.models}
        self._clock, self._wall = clock, wall
        self._on_gone = on_gone
        self._waiters: dict[str, asyncio.Future[Decision]] = {}
        self._early: dict[str, Decision] = {}
        """Decisions made inside the request's own event (taken back at once)."""
        self._seen: dict[str, tuple[ReplicaSeen, ...]] = {}
        self._noticed: dict[ReplicaId, tuple[str | None, float]] = {}
        """The last preemption notice handed on per replica: its process (URL) and deadline
        (wall clock)."""
        self._standbys: dict[str, object] = {}
        self._held: dict[str, int] = {}
        self._shown: dict[str, FleetView] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._tasks: asyncio.TaskGroup | None = None
        self._client: ReplicaClient | None = None
        self._record: IO[str] | None = None
        self._flushed = 0.0
        self.deadlines: dict[str, asyncio.Timeout] = {}
        """The timeout of each request's attempt in flight (the app's), by request id: what
        an :class:`Abandon` ends it with."""
        self.abandoned: set[str] = set()
        """Requests whose attempt an Abandon ended, or ends as it starts (decided before):
        the app says why, and takes them out when the attempt ends."""
        self.recalled: set[str] = set()
        """Those of them a :class:`Recall` ended (a batch line's slot went to interactive)."""
        self.on_rollout: Callable[[float, RolloutStep], None] | None = None
        """Where RolloutStep commands go (``_rollouts.RolloutShell``)."""
        self.first_bytes: dict[str, float] | None = {} if self.control.times_first_tokens else None
        """Each request's TTFT, from its first byte to its ``Finished``, when the controller
        reads it (the batch gate's TTFT guard; ``None``: it does not)."""
        self.sampled: frozenset[str] = frozenset()
        """The pools a rollout watches: their requests' latencies are sampled."""
        self._samples: dict[str, tuple[list[float], list[float]]] = {}
        self.residency = (
            None
            if self.control.residency is None
            else ResidencyShell(ResidencyMetrics(metrics.registry), self._url_of, self._resident)
        )
        """Sleep and Wake over HTTP (``None``: every pool is always resident)."""
        self._residency_shown = -1
        self.adapters = AdapterShell.of(self.control, metrics.registry)
        """LoRA adapter loads and unloads over HTTP (``None``: the fleet serves none)."""
        self._kv_pools = frozenset(n for n, p in self.pools.items() if p.settings.kv_events)
        """Pools whose router reads KV events (their engines are subscribed to)."""
        self._kv_names = {
            name: pool
            for name, served in self.control.served.items()
            for pool in [next((p for p, _ in served.variants if p in self._kv_pools), None)]
            if pool is not None
        }
        # a batch changes its pool's router only: the cheap path of a request's event
        self.kv_feeds = KvFeeds(lambda event: self.handle(event, request=True))
        """One subscription per engine that publishes KV events (docs/kv-events.md)."""

    # -- life -----------------------------------------------------------------------------

    def start(self, tasks: asyncio.TaskGroup, client: ReplicaClient) -> None:
        """Probes and scrapes from now on run in ``tasks`` over ``client``."""
        self._tasks, self._client = tasks, client
        self._arm(self._clock(), self.control.next_wakeup())
        if self._kv_pools:
            self.kv_feeds.start(tasks)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        self._tasks = None
        self.kv_feeds.stop()
        if self._record is not None:
            self._record.flush()

    def record(self, out: IO[str]) -> None:
        """Write every event and its commands to ``out`` (a recording ``gpufleet replay``
        reads)."""
        self._record = out
        self.control.record(out)

    # -- the one way in -------------------------------------------------------------------

    def handle(self, event: Event, *, request: bool = False) -> list[Command]:
        """Hand ``event`` to the controller and carry out what it says. ``request``: a
        request's event, which can have changed only the view and wake-up of the pool it
        reached (``FleetController.touched``; ``None``: it moved to a fallback's)."""
        now = self._clock()
        control = self.control
        commands = control.handle(now, event)
        for command in commands:
            if isinstance(command, _DECISIONS):
                if isinstance(command, Route) and command.load:
                    self._load(command)
                waiter = self._waiters.pop(command.request_id, None)
                if waiter is None:  # decided inside its own event: taken back at once
                    self._early[command.request_id] = command
                elif not waiter.done():
                    waiter.set_result(command)
            else:
                self._carry_out(now, command)
        if self.residency is not None:
            self._show_residency()
        model = control.touched if request else None
        pool = None if model is None else self.pools.get(model)
        if pool is None:
            for name, each in self.pools.items():
                self._show(name, each)
            self._arm(now, control.next_wakeup())
        else:
            if pool.view is not self._shown.get(pool.model) or pool.autoscaler is not None:
                self._show(pool.model, pool)
            # the other pools' wake-ups did not move, and the timer is at or before them
            wake = pool.next_wakeup()
            if wake is not None and wake < self._timer_at:
                self._arm(now, wake)
        return commands

    def _carry_out(self, now: float, command: Command) -> None:  # noqa: PLR0912 - per command
        """A command other than a request's decision."""
        if isinstance(command, Probe):
            if self._tasks is not None:
                self._tasks.create_task(self._probe(command.model, command.replica))
        elif isinstance(command, Ejected):
            r = command.record
            enforced = "true" if r.enforced else "false"
            self.metrics.ejections.labels(r.model, r.cause.value, enforced).inc()
            self.timeline.ejected(now, r)
        elif isinstance(command, Scale):
            if self.scaling is not None:
                self.scaling.carry_out(now, command)
            self.timeline.scaled(now, command)
        elif isinstance(command, Fallback):
            metrics = self.metrics
            metrics.child(metrics.fallbacks, command.model, command.to, command.reason).inc()
        elif isinstance(command, RolloutStep):
            self.sampled = frozenset(self.control.rollouts.watched)
            if self.on_rollout is not None:
                self.on_rollout(now, command)
        elif isinstance(command, Sleep | Wake):
            shell, tasks, client = self.residency, self._tasks, self._client
            if shell is not None and tasks is not None and client is not None:
                if isinstance(command, Sleep):
                    tasks.create_task(shell.sleep(client, command))
                else:
                    tasks.create_task(shell.wake(client, command))
        elif isinstance(command, KvResync):
            self.kv_feeds.resync(command, self.upstreams.get(command.replica))
        elif isinstance(command, Abandon):
            self.metrics.child(self.metrics.abandoned, command.model).inc(len(command.request_ids))
            self.abandon(command.request_ids)
        elif isinstance(command, Recall):
            self.metrics.child(self.metrics.recalls, command.model).inc()
            self.recalled.add(command.request_id)
            self.abandon((command.request_id,))
        elif isinstance(command, UnloadAdapter):
            url, client = self._url_of(command.replica), self._client
            if self.adapters is not None and url is not None and client is not None:
                self.adapters.unload(client, command.replica, url, command.adapter)

    def abandon(self, request_ids: Iterable[str]) -> None:
        """End these requests' attempts now: each one's timeout falls due (the app reports a
        ``TIMEOUT``, and the controller retries or resumes it); one not started yet is ended
        as it starts (:meth:`attempting`)."""
        now = asyncio.get_running_loop().time()
        for rid in request_ids:
            self.abandoned.add(rid)
            deadline = self.deadlines.get(rid)
            if deadline is not None:
                deadline.reschedule(now)

    def attempting(self, rid: str, deadline: asyncio.Timeout) -> None:
        """Request ``rid``'s attempt runs under ``deadline`` (until :meth:`attempted`)."""
        self.deadlines[rid] = deadline
        if rid in self.abandoned:  # abandoned between its Route and now
            deadline.reschedule(asyncio.get_running_loop().time())

    def attempted(self, rid: str) -> bool:
        """Request ``rid``'s attempt ended; whether an Abandon or a Recall ended it."""
        self.deadlines.pop(rid, None)
        if rid in self.abandoned:
            self.abandoned.discard(rid)
            return True
        return False

    def take_recalled(self, rid: str) -> bool:
        """Whether the end of ``rid``'s attempt was a Recall's (asked once, after
        :meth:`attempted` said it was abandoned)."""
        if rid in self.recalled:
            self.recalled.discard(rid)
            return True
        return False

    def _load(self, route: Route) -> None:
        """A Route that loads its adapter first: the load starts now."""
        adapters, client, url = self.adapters, self._client, self._url_of(route.replica)
        if adapters is not None and client is not None and url is not None:
            adapters.begin(client, route.replica, url, route.load)

    async def adapter_ready(self, route: Route, served: str) -> None:
        """Before an attempt of a request for served name ``served``: when it is a LoRA
        adapter, return once the route's replica has it loaded (its Route's load, or one
        under way there). ``UpstreamError``: the load failed (the attempt fails)."""
        adapters = self.adapters
        if adapters is not None and adapters.is_adapter(served):
            await adapters.ready(route.replica, served)

    def _url_of(self, replica: ReplicaId) -> str | None:
        upstream = self.upstreams.get(replica)
        return None if upstream is None else upstream.url

    def _resident(self, event: Resident) -> None:
        """A Sleep or Wake ended (its task): tell the controller, unless the gateway stops."""
        if self._tasks is not None:
            self.handle(event)

    def _show_residency(self) -> None:
        residency = self.control.residency
        assert residency is not None
        assert self.residency is not None
        if residency.version != self._residency_shown:
            self._residency_shown = residency.version
            for model in self.pools:
                if residency.manages(model):
                    self.residency.metrics.show(model, residency.replicas_of(model))

    def _show(self, model: str, pool: PoolController) -> None:
        """Show the pool's view (and its held requests) where they changed."""
        self._shown[model] = pool.view
        self.views.export(model, pool.view)
        if pool.autoscaler is not None and self.scaling is not None:
            held = pool.held
            if self._held.get(model) != held:
                self._held[model] = held
                self.scaling.held(model, held)

    def _arm(self, now: float, wake: float | None) -> None:
        """Wake at ``wake`` if that is sooner than the timer (a timer never moves later:
        a tick with nothing due is harmless)."""
        if wake is None or wake >= self._timer_at or self._tasks is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = asyncio.get_running_loop().call_later(max(wake - now, 0.0), self.tick)

    @property
    def wake_at(self) -> float:
        """When the timer fires next (``inf``: not armed)."""
        return self._timer_at

    def tick(self) -> None:
        """The timer's callback: whatever fell due (a test may call it at :attr:`wake_at`)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        try:
            if self.scaling is not None:
                self._report_standbys()
            self._report_samples()
            self.handle(Tick())
            self._flush_record()
        except Exception:  # a controller bug must not stop the clock
            logger.exception("the control loop failed on a tick")
            now = self._clock()
            self._timer_at = now + _RETRY_TICK
            self._timer = asyncio.get_running_loop().call_later(_RETRY_TICK, self.tick)

    def _flush_record(self) -> None:
        """A recording reaches its file about once a second (a killed gateway loses less)."""
        if self._record is not None:
            now = self._clock()
            if now - self._flushed >= _FLUSH_EVERY:
                self._flushed = now
                self._record.flush()

    def sample(self, pool: str, ttft: float, itl: float | None = None) -> None:
        """A request on ``pool`` (one of :attr:`sampled`) was answered: its time to first
        byte and, if known, its mean inter-token latency; told to the controller in one
        ``Latencies`` per pool before the next Tick."""
        ttfts, itls = self._samples.setdefault(pool, ([], []))
        ttfts.append(ttft)
        if itl is not None:
            itls.append(itl)

    def _report_samples(self) -> None:
        samples, self._samples = self._samples, {}
        for pool, (ttft, itl) in samples.items():
            self.handle(Latencies(pool, tuple(ttft), tuple(itl)))

    def _report_standbys(self) -> None:
        assert self.scaling is not None
        for model in self.scaling.models:
            standbys = self.scaling.actuator.standbys(model)
            if self._standbys.get(model) != standbys:
                self._standbys[model] = standbys
                self.handle(Standbys(model, standbys))

    # -- a request ------------------------------------------------------------------------

    async def arrive(
        self,
        request: RouteRequest,
        priority: int = 0,
        weight: float = 1.0,
        deadline: float | None = None,
        *,
        resumable: bool = False,
        recallable: bool = False,
        budget: float | None = None,
    ) -> Decision:
        """The request's first decision: a Route, or a Reject; it may wait (queued, held).
        Cancelled (the client left): the caller reports :meth:`gone`. ``resumable``: its
        stream can be resumed on another replica if it breaks after the first byte;
        ``recallable``: its answer comes whole (an attempt may be stopped and run again);
        ``budget``: the seconds to its first token it allows (``x-gpufleet-ttft-budget-ms``).
        ``request.model`` is the served name; a Route's ``model`` names the pool chosen."""
        arrived = Arrived(request, priority, weight, deadline, resumable, recallable, budget)
        self.handle(arrived, request=True)
        decision = self._early.pop(request.request_id, None)  # mostly: decided at once
        if decision is None:
            decision = await self._decision(request.request_id)
        if self.scaling is not None:  # the hold's outcomes (autoscaled pools)
            pool = decision.model or request.model
            if isinstance(decision, Route):
                if decision.held:
                    self.scaling.hold_ended(pool, "served")
            elif decision.reason == RejectReason.HOLD_FULL:
                self.scaling.hold_ended(pool, "full")
            elif decision.reason == RejectReason.HOLD_TIMEOUT:
                self.scaling.hold_ended(pool, "timeout")
        return decision

    async def _decision(self, rid: str) -> Decision:
        """Request ``rid``'s decision: made inside its own event, or awaited (cancelled when
        its client leaves: the caller reports :meth:`gone`)."""
        decision = self._early.pop(rid, None)
        if decision is None:
            waiter: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
            self._waiters[rid] = waiter
            try:
                decision = await waiter
            finally:
                self._waiters.pop(rid, None)
        return decision

    def failed(
        self, model: str, rid: str, outcome: Outcome, *, streamed: bool = False
    ) -> Coroutine[None, None, Decision]:
        """The attempt (on pool ``model``) failed, told to the controller now; await the
        next Route (a retry, a resume, or the first attempt in a fallback's pool, which may
        wait in its queue) or the Reject that ends it."""
        if self.first_bytes:
            self.first_bytes.pop(rid, None)  # a later attempt's first byte is the one told
        self.handle(AttemptFailed(model, rid, outcome, streamed), request=True)
        return self._failed(model, rid, outcome)

    async def _failed(self, model: str, rid: str, outcome: Outcome) -> Decision:
        decision = await self._decision(rid)
        metrics = self.metrics
        if isinstance(decision, Route):
            if decision.retry or decision.resume:  # not a fallback's first attempt
                metrics.child(metrics.retries, model, outcome.value).inc()
        elif decision.budget:
            metrics.child(metrics.retries_refused, model).inc()
        return decision

    def finished(
        self, model: str, rid: str, outcome: Outcome, work: tuple[int, int] | None = None
    ) -> None:
        # abandoned or recalled as its answer came: nothing was left to end
        self.abandoned.discard(rid)
        self.recalled.discard(rid)
        ttft = self.first_bytes.pop(rid, None) if self.first_bytes else None
        if outcome is not Outcome.SUCCESS:
            ttft = None
        self.handle(Finished(model, rid, outcome, work, ttft), request=True)

    def first_byte(self, rid: str, ttft: float) -> None:
        """Request ``rid``'s answer began ``ttft`` seconds after it arrived: told with its
        ``Finished`` when the controller reads it (the batch gate's TTFT guard)."""
        if self.first_bytes is not None:
            self.first_bytes[rid] = ttft

    def gone(self, model: str, rid: str) -> None:
        self.abandoned.discard(rid)  # abandoned before its attempt began, which never will
        self.recalled.discard(rid)
        if self.first_bytes:
            self.first_bytes.pop(rid, None)
        self.handle(ClientGone(model, rid), request=True)

    def hashes(self, name: str) -> bool | None:
        """Whether requests to served name ``name`` need prefix hashes (a pool it can
        reach routes by prefix); ``None``: clients may not send ``name`` as ``model`` (not a
        served name or alias)."""
        served = self.control.served.get(name)
        return None if served is None else served.hashes

    def kv_pool(self, name: str) -> str | None:
        """The pool whose engines' block hashes a request to served name ``name`` needs
        (its first variant that reads KV events), or ``None``: none does."""
        return self._kv_names.get(name)

    def refusal(self, model: str, reject: Reject, last: UpstreamError | None) -> GatewayError:
        """The error a Reject answers with (503 with ``Retry-After``); ``model``: the name
        the client sent (the pool it was last in is ``reject.model``, if another)."""
        retry_after = self.config.gateway.retry_after
        reason = reject.reason
        if reason == RejectReason.SHED:
            return AdmissionError(
                f"the gateway's queue for `{model}` is full (lower-priority work is shed first)",
                1,
            )
        if reason == RejectReason.EXPIRED:
            return AdmissionError(
                f"`{model}` is saturated and the request could not start before its deadline", 1
            )
        if reason == RejectReason.HOLD_FULL:
            held = self.pools[reject.model or model].held
            return NoReplicaError(
                f"no replica of `{model}` is ready and {held} requests already wait for one",
                retry_after,
            )
        if reason == RejectReason.HOLD_TIMEOUT:
            timeout = self.config.gateway.autoscaler.hold_timeout
            return NoReplicaError(
                f"no replica of `{model}` became ready within {timeout:g} s", retry_after
            )
        if reason == RejectReason.NO_REPLICA:
            return NoReplicaError(f"no replica of `{model}` can take the request now", retry_after)
        why = f": {last}" if last is not None else ""
        return NoReplicaError(f"no replica of `{model}` could take the request{why}", retry_after)

    # -- the runtime ----------------------------------------------------------------------

    def set_replicas(self, replicas: Sequence[Upstream]) -> None:
        """The owner's list of replicas (every one, every time)."""
        known = self.upstreams
        fresh = {r.name: r for r in replicas if r.model in self.pools}
        gone = [known[name] for name in known.keys() - fresh.keys()]
        self.upstreams = fresh
        for model in self.pools:
            seen = tuple(
                ReplicaSeen(r.name, r.state, r.url) for r in fresh.values() if r.model == model
            )
            if self._seen.get(model) != seen:
                self._seen[model] = seen
                self.handle(Replicas(model, seen))
        if self._kv_pools:  # after the controller knows each process (its incarnation)
            self.kv_feeds.update(
                {n: (u.model, u) for n, u in fresh.items() if u.model in self._kv_pools}
            )
        for upstream in fresh.values():  # after it knows each process too
            if upstream.reclaim_at is not None:
                self._reclaim_notice(upstream, upstream.reclaim_at)
        for replica in gone:
            self._noticed.pop(replica.name, None)
            self.views.forget(replica.name)
            if self.adapters is not None:
                self.adapters.forget(replica.name)
            # its other series and cached children (queue, KV, attempts, in flight)
            self.metrics.forget_replica(replica.name)
            if self._on_gone is not None:
                self._on_gone(replica)

    def _reclaim_notice(self, replica: Upstream, at: float) -> None:
        """The owner says the provider takes ``replica`` back at ``at`` (wall clock): the
        controller hears ``Preempting`` with that deadline on its own clock. Every list
        repeats the notice; each one is handed on once (again if its deadline or the
        replica's process changes: what a notice does, a later one included, is the
        controller's rule)."""
        if self._noticed.get(replica.name) == (replica.url, at):
            return
        self._noticed[replica.name] = (replica.url, at)
        now = self._clock()
        notice = max(0.0, at - self._wall())
        self.handle(Preempting(replica.model, replica.name, now + notice))
        text = f"{replica.name}: preemption notice ({notice:.0f} s) from its runtime"
        self.timeline.add(now, "action", replica.model, text, replica=replica.name)

    async def _probe(self, model: str, replica: ReplicaId) -> None:
        upstream = self.upstreams.get(replica)
        client = self._client
        if upstream is None or upstream.url is None or client is None:
            return
        timeout = self._models[model].health.active.timeout
        try:
            async with asyncio.timeout(timeout):
                status, _ = await client.get(upstream.url + "/health", timeout)
            ok = status == 200
        except (TimeoutError, UpstreamError):
            ok = False
        if self._tasks is not None and replica in self.upstreams:
            self.handle(ProbeAnswered(model, replica, ok))

    async def scrape_loop(self, scraped: frozenset[str]) -> None:
        """Scrape the engines of the ``scraped`` pools every ``scrape_interval``."""
        interval = self.config.gateway.scrape_interval
        while True:
            targets = [
                (u.model, name, u.url)
                for name, u in self.upstreams.items()
                if u.model in scraped and u.url is not None
            ]
            results = await asyncio.gather(*(self._scrape(url) for _, _, url in targets))
            # every scraped pool gets its round, even one with no answer (as simulated)
            loads: dict[str, dict[ReplicaId, tuple[int, int, float]]] = {m: {} for m in scraped}
            for (model, name, _), result in zip(targets, results, strict=True):
                if result is not None:
                    loads[model][name] = result
            for model, rows in loads.items():
                self.scraped(model, rows)
            await asyncio.sleep(interval)

    def scraped(self, model: str, loads: dict[ReplicaId, tuple[int, int, float]]) -> None:
        """A scrape round of ``model``'s engines: (running, waiting, KV usage) by replica."""
        rows = []
        for name, (running, waiting, kv) in loads.items():
            if name in self.upstreams:  # not one that left while it was scraped
                rows.append(ScrapedLoad(name, running, waiting, kv))
                self.metrics.queue.labels(name).set(waiting)
                self.metrics.kv_usage.labels(name).set(kv)
        self.handle(Scraped(model, tuple(rows)))

    async def _scrape(self, url: str) -> tuple[int, int, float] | None:
        client = self._client
        assert client is not None
        timeout = max(self.config.gateway.scrape_interval * 5, 0.5)
        try:
            async with asyncio.timeout(timeout):
                status, body = await client.get(url + "/metrics", timeout)
        except (TimeoutError, UpstreamError):
            return None
        if status != 200:
            return None
        return parse_engine_metrics(body.decode("utf-8", "replace"))

    # -- questions ------------------------------------------------------------------------

    def ready(self) -> dict[str, int]:
        """Routable replicas per model."""
        return {name: len(pool.routable()) for name, pool in self.pools.items()}
