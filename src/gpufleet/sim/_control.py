"""The simulator's shell around the pool controller: kernel events in, commands carried out.

The gateway's control loop runs here unchanged (``gpufleet.control``); this module only
turns the simulated world into its events and does what it says::

    Arrival          ─► Arrived(RouteRequest: served name, prefix hashes, prompt tokens,
                                tenant, session: what picks its variant)
    replica ends     ─► Finished(work: uncached prompt, output tokens)
    crash            ─► AttemptFailed(streamed: had its first token) · Replicas(no process)
                        (every request is resumable: Arrived(resumable=True))
    restart / join   ─► Replicas(new incarnation)      drain / leave ─► Replicas
    scrape tick      ─► Scraped(running, waiting, KV usage of each scraped replica)
    a step's KV events ─► KvEvents(one batch, numbered per process; prefix_precise pools)
    Wake @ next_wakeup() ─► Tick
    ─────────────────────────────────────────────────────────────────────────────────────
    Route  ─► drivers[k].submit (at once; from a replica's step end, by a Dispatch event at
              that instant, since one replica's event may not touch another); a resume:
              the prompt plus the tokens generated so far (FleetHarness.submit_resume)
    Reject ─► an error row (the gateway's 503, or a stream cut mid-way)
    Fallback ─► nothing (the controller counts them; its next Route or Reject follows)
    RolloutStep ─► rollout_log (the report's ``rollouts``, rollout.png)
    a request ends on a pool a rollout watches ─► Latencies(its TTFT, its mean ITL)
    (the fleet file's rollout blocks start when the run does: RolloutStart at t = 0)
    Probe  ─► answered at once: ok unless the replica is down
    Recall ─► the batch line leaves its modelled engine (a cut connection) and reports
              AttemptFailed(CANCELLED); it waits at the gate, then runs again from its start
    Scale  ─► the modelled runtime (``gpufleet.sim._autoscale``)
    Sleep / Wake ─► the replica's modelled sleep / wake time (``perf.residency_times``),
              then Resident (a Sleep drops the replica's prefix cache, as vLLM's does)

:class:`SimReplicas` is the one registry of the simulated runtime: each replica's id, pool,
driver, state and incarnation, in the order the controller sees them (serving replicas in
the order they joined, then those still starting).

Prefix hashes name token blocks: the gateway hashes the prompt *text* in blocks of 512
characters, chained (:func:`~gpufleet.fleet.text_prefix_hashes`); the simulator has token
ids, so it chains hashes over blocks of :data:`PREFIX_HASH_TOKENS` = 128 ids (512 characters
at ~4 characters per token), at most 256 blocks, tail dropped. Trace prefix blocks
(``hash_ids``: 512 tokens, or a recording's 128) are whole multiples of 128, so a block the
trace shares is a run of hashes the router sees shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gpufleet.catalog import get_gpu, get_model
from gpufleet.control import (
    Abandon,
    Arrived,
    AttemptFailed,
    Command,
    Ejected,
    EjectionRecord,
    Fallback,
    Finished,
    FleetController,
    KvEvents,
    KvResync,
    Latencies,
    Preempting,
    Probe,
    ProbeAnswered,
    Recall,
    Reclaimed,
    Reject,
    Replace,
    Replicas,
    ReplicaSeen,
    Residency,
    Resident,
    RolloutDecision,
    RolloutStep,
    Route,
    Scale,
    Scraped,
    ScrapedLoad,
    Sleep,
    SpotMarket,
    Standby,
    Standbys,
    Tick,
    UnloadAdapter,
    asleep_at,
)
from gpufleet.control import Event as ControlEvent
from gpufleet.control import Wake as WakeCommand
from gpufleet.engine.model import (
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    block_hash_chain,
    external_hash,
)
from gpufleet.fleet import (
    KvBatch,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvStored,
    Outcome,
    ReplicaId,
    ReplicaState,
    RouteRequest,
)
from gpufleet.perf import Parallelism, ResidencyTimes, residency_times
from gpufleet.sim._adapters import SimAdapters
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._kernel import URGENT, Event, ScheduledEvent
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._traces import PREFIX_HASH_TOKENS, TraceRequest

PREFIX_HASH_MAX_BLOCKS: Final = 256
"""At most this many blocks are hashed, as in the gateway."""
KV_MAX_BLOCKS: Final = 16384
"""At most this many engine blocks of a prompt are hashed for KV-event routing (the sim
engine's hasher's bound)."""


def _kv_event(event: KvCacheEvent) -> KvEvent:
    """A replica model's KV event as the controller reads it (hashes as 64-bit integers)."""
    if isinstance(event, BlockStored):
        return KvStored(tuple(map(external_hash, event.block_hashes)))
    if isinstance(event, BlockRemoved):
        return KvRemoved(tuple(map(external_hash, event.block_hashes)))
    return KvCleared()


def token_prefix_hashes(
    ids: Sequence[int],
    block_tokens: int = PREFIX_HASH_TOKENS,
    max_blocks: int = PREFIX_HASH_MAX_BLOCKS,
) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full ``block_tokens``-id blocks of ``ids``.

    The token-id twin of :func:`gpufleet.fleet.text_prefix_hashes`: ``h0 = H(0, b0)``,
    ``h1 = H(h0, b1)``, … Hashes of integer tuples are not salted, so the chain is the same
    in every process (a seeded run stays one run).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    ids = tuple(ids)
    end = min(len(ids) // block_tokens, max_blocks) * block_tokens
    hashes: list[int] = []
    chained = 0
    for start in range(0, end, block_tokens):
        chained = hash((chained, ids[start : start + block_tokens]))
        hashes.append(chained)
    return tuple(hashes)


@dataclass(slots=True)
class SimReplica:
    """One replica of the simulated runtime."""

    id: ReplicaId
    model: str
    state: ReplicaState
    driver: int | None = None
    """Its driver index once it serves (``None`` while it cold-starts or is promoted)."""
    incarnation: int | None = 0
    """Its process (``None``: none now: crashed, or not started yet)."""
    restarts: int = 0
    last_end: float = 0.0
    """When its last request ended (a drained replica leaves then)."""


class SimReplicas:
    """The simulated runtime's replicas, per pool: serving ones in join order, then the
    ones still starting; a driver index names each serving one for good."""

    __slots__ = ("by_driver", "by_id", "pools", "starting")

    def __init__(self, pools: Sequence[str]) -> None:
        self.pools: dict[str, list[SimReplica]] = {p: [] for p in pools}
        self.starting: dict[str, list[SimReplica]] = {p: [] for p in pools}
        self.by_driver: list[SimReplica] = []
        self.by_id: dict[ReplicaId, SimReplica] = {}

    def seen(self, model: str) -> Replicas:
        """The pool as the runtime reports it (stopped replicas left out)."""
        return Replicas(
            model,
            tuple(
                ReplicaSeen(r.id, r.state, None if r.incarnation is None else str(r.incarnation))
                for r in (*self.pools[model], *self.starting[model])
                if r.state is not ReplicaState.STOPPED
            ),
        )

    def members(self, model: str) -> list[int]:
        """Driver indices of ``model``'s replicas that are not stopped, oldest first."""
        return [
            r.driver
            for r in self.pools[model]
            if r.driver is not None and r.state is not ReplicaState.STOPPED
        ]


@dataclass(frozen=True, slots=True)
class Wake:
    """The controller asked to be woken now (``next_wakeup``)."""

    target: SimControl


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Carry out commands that arose inside one replica's step end, at that instant."""

    target: SimControl
    commands: tuple[Command, ...]


@dataclass(frozen=True, slots=True)
class Later:
    """What the modelled world tells the controller a while after it was asked (an engine
    fell asleep or woke up, a probe timed out): tell it then."""

    target: SimControl
    event: ControlEvent


@dataclass(slots=True)
class _Pending:
    request: TraceRequest
    prompt: tuple[int, ...]


class SimControl:
    """The harness's gate and routing seam, around one :class:`~gpufleet.control.FleetController`.

    Built with the fleet's initial replicas (``counts`` per pool, in the fleet file's order,
    named ``<pool>-<i>`` as the gateway names them) as drivers ``0 .. n-1``.
    ``tenant_of(index, request) -> (tenant, priority, weight)`` says who sent a request.
    Call :meth:`attach` after ``FleetHarness.start``.
    """

    def __init__(  # noqa: PLR0915 - a field a line
        self,
        control: FleetController,
        counts: Sequence[int],
        *,
        scrape_interval: float,
        tenant_of: Callable[[int, TraceRequest], tuple[str, int, float]] | None = None,
        on_refuse: Callable[[int, str], None] | None = None,
        block_sizes: Mapping[str, int] | None = None,
        deadlines: Mapping[str, float] | None = None,
        whole: frozenset[str] = frozenset(),
    ) -> None:
        self.control = control
        pools = list(control.pools)
        self.replicas = SimReplicas(pools)
        self._named = dict.fromkeys(pools, 0)
        for model, count in zip(pools, counts, strict=True):
            if count < 1:
                raise ValueError(f"model {model!r} has no replicas to simulate")
            for _ in range(count):
                self._join(model, self._new(model, ReplicaState.READY, incarnation=0))
        self.scrape_interval = scrape_interval
        self._tenant_of = tenant_of
        self._on_refuse = on_refuse
        self._deadlines = deadlines or {}
        """Per tenant, the time by which its requests must have started (a batch job's
        lines: the end of its window); a tenant not here waits its class's ``max_wait``."""
        self._whole = whole
        """Tenants whose requests ask for whole answers, not streams (a batch job's lines,
        as the runner sends them): one lost mid-way is sent again from the start."""
        self._whole_ids: set[int] = set()
        self.blackout: set[int] = set()
        """Replicas whose scrapes do not update (a metric blackout)."""
        self.hung: set[int] = set()
        """Replicas whose process is stopped: no probe or scrape is answered (a hang)."""
        self.erroring: set[int] = set()
        """Replicas that answer each new attempt with a 5xx (an ``errors`` fault)."""
        self.refused_attempts = 0
        """Attempts an erroring replica answered with a 5xx."""
        self.scrapes = 0
        self.ejections: list[EjectionRecord] = []
        self.refused_pool: dict[int, str] = {}
        """The pool of each request that failed without ever reaching a replica."""
        self.arrivals = 0
        """Requests that arrived (a pool counts those that fell back to it too)."""
        self.waits: dict[int, float] = {}
        """Seconds each request waited before its first attempt (queued or held)."""
        self.on_scale: Callable[[float, Scale], None] | None = None
        """The modelled runtime's actuator (``Autoscaling.act``)."""
        self.on_replace: Callable[[float, Replace], list[ScheduledEvent]] | None = None
        """The modelled provider: a node of the capacity asked for (``FaultInjector``)."""
        self.on_wake: Callable[[float], None] | None = None
        """Called before each Tick (the modelled runtime retires drained replicas)."""
        self.rollout_log: list[RolloutDecision] = []
        """Every rollout step and verdict, in order."""
        self._harness: FleetHarness | None = None
        self._pending: dict[int, _Pending] = {}
        self._wake_at: float | None = None
        self._local = False
        self._deferred: list[Command] = []
        self._timed = control.times_first_tokens
        """Whether ``Finished`` carries the request's TTFT (the batch gate's guard reads it)."""
        self.recalls = 0
        """Recall commands carried out (batch lines stopped for an interactive request)."""
        self._times: dict[str, ResidencyTimes] = {}
        self._levels: dict[ReplicaId, int] = {}
        self.sleeps = 0
        self.wake_seconds: list[float] = []
        """The modelled time of each wake carried out."""
        sizes = block_sizes or {}
        self._kv_names: dict[str, int] = {}
        """Served name → the engine block size its prompts are hashed in (a name whose first
        variant that routes on KV events is such a pool; docs/kv-events.md)."""
        for name, served in control.served.items():
            for pool, _ in served.variants:
                if control.pools[pool].settings.kv_events:
                    self._kv_names[name] = sizes.get(pool, 16)
                    break
        self._kv_seq: dict[int, int] = {}
        """Per driver, its process's next KV-event batch number."""
        self.adapters = SimAdapters.of(control.fleet)
        """The modelled engines' LoRA adapter loads (``None``: the fleet serves none)."""
        self._adapter_of: dict[int, str] = {}
        """Each request for a LoRA adapter: the adapter (its served name)."""

    # -- the registry ---------------------------------------------------------------------

    def _new(self, model: str, state: ReplicaState, *, incarnation: int | None) -> SimReplica:
        replica = SimReplica(self.next_name(model), model, state, incarnation=incarnation)
        self.replicas.by_id[replica.id] = replica
        return replica

    def _join(self, model: str, replica: SimReplica) -> int:
        replica.driver = len(self.replicas.by_driver)
        self.replicas.by_driver.append(replica)
        self.replicas.pools[model].append(replica)
        return replica.driver

    @property
    def replica_ids(self) -> list[ReplicaId]:
        """Every serving replica's name, in driver order (stopped ones included)."""
        return [r.id for r in self.replicas.by_driver]

    def pool_names(self) -> list[str]:
        return list(self.control.pools)

    def members(self, model: str) -> list[int]:
        return self.replicas.members(model)

    def state(self, replica: int) -> ReplicaState:
        """What the runtime says of driver ``replica``."""
        return self.replicas.by_driver[replica].state

    def last_end(self, replica: int) -> float:
        return self.replicas.by_driver[replica].last_end

    def model_of(self, request: TraceRequest) -> str:
        """The served name ``request`` asks for: the one its trace names, else the first
        (``FleetConfig.served_names``: a pool's own name, or a ``served`` entry's)."""
        model = request.model
        served = self.control.served
        return model if model is not None and model in served else next(iter(served))

    def provision(self, now: float, model: str) -> ReplicaId:
        """A replica of ``model`` starts (a cold start): listed as starting, no process."""
        replica = self._new(model, ReplicaState.STARTING, incarnation=None)
        self.replicas.starting[model].append(replica)
        self._report(now, self.replicas.seen(model))
        return replica.id

    def promoting(self, now: float, model: str, replica: ReplicaId) -> None:
        """A standby is being promoted: listed as starting until it joins."""
        entry = SimReplica(replica, model, ReplicaState.STARTING, incarnation=None)
        self.replicas.by_id[replica] = entry
        self.replicas.starting[model].append(entry)
        self._report(now, self.replicas.seen(model))

    def next_name(self, model: str) -> ReplicaId:
        """The name the next replica of ``model`` gets (standbys are named too)."""
        n = self._named[model]
        self._named[model] = n + 1
        return ReplicaId(f"{model}-{n}")

    def cancel(self, now: float, replica: ReplicaId) -> None:
        """A replica still starting is cancelled (drained before it served)."""
        entry = self.replicas.by_id.get(replica)
        if entry is not None and entry in self.replicas.starting[entry.model]:
            self.replicas.starting[entry.model].remove(entry)
            entry.state = ReplicaState.STOPPED
            self._report(now, self.replicas.seen(entry.model))

    def add_replica(self, now: float, model: str, replica: ReplicaId) -> int:
        """``replica`` of ``model`` is up, as the harness's next driver (its index is
        returned): a new process, whose checks start over."""
        entry = self.replicas.by_id.get(replica)
        if entry is None or entry.driver is not None:
            entry = SimReplica(replica, model, ReplicaState.READY)
            self.replicas.by_id[replica] = entry
        else:
            self.replicas.starting[model].remove(entry)
        entry.state, entry.incarnation, entry.last_end = ReplicaState.READY, 0, now
        k = self._join(model, entry)
        self._report(now, self.replicas.seen(model))
        return k

    def drain_replica(self, now: float, replica: int) -> None:
        """Scale-in: ``replica`` takes no new request; it finishes those it has."""
        entry = self.replicas.by_driver[replica]
        if entry.state is not ReplicaState.STOPPED:
            entry.state = ReplicaState.DRAINING
            self._report(now, self.replicas.seen(entry.model))

    def remove_replica(self, now: float, replica: int) -> None:
        """``replica`` is gone (drained): out of the pool."""
        entry = self.replicas.by_driver[replica]
        if entry.state is ReplicaState.STOPPED:
            return
        entry.state = ReplicaState.STOPPED
        self.replicas.pools[entry.model].remove(entry)
        self._report(now, self.replicas.seen(entry.model))

    def replica_down(self, now: float, replica: int) -> None:
        """The runtime saw ``replica`` die: no process until :meth:`replica_up`."""
        entry = self.replicas.by_driver[replica]
        entry.incarnation = None
        if entry.state is not ReplicaState.DRAINING and entry.state is not ReplicaState.STOPPED:
            entry.state = ReplicaState.STARTING
        self._report(now, self.replicas.seen(entry.model))

    def replica_up(self, now: float, replica: int) -> None:
        """``replica`` restarted: a new process, whose checks start over."""
        entry = self.replicas.by_driver[replica]
        entry.restarts += 1
        self._kv_seq.pop(replica, None)  # the new process counts its batches from 0
        if entry.state is ReplicaState.DRAINING or entry.state is ReplicaState.STOPPED:
            return
        entry.state, entry.incarnation = ReplicaState.READY, entry.restarts
        self._report(now, self.replicas.seen(entry.model))

    def preempting(self, now: float, replica: int, at: float) -> list[ScheduledEvent]:
        """The provider takes driver ``replica``'s GPUs at ``at``: the controller hears the
        notice (what it says, an abandon included, is returned to schedule)."""
        entry = self.replicas.by_driver[replica]
        return self._tell(now, Preempting(entry.model, entry.id, at))

    def reclaimed(self, now: float, replica: int) -> list[ScheduledEvent]:
        """The provider took driver ``replica``'s GPUs: the controller says what replaces
        them (a ``Replace`` now, or later on a ``SpotMarket``)."""
        entry = self.replicas.by_driver[replica]
        return self._tell(now, Reclaimed(entry.model, entry.id))

    def spot_market(self, now: float, model: str, available: bool) -> list[ScheduledEvent]:
        """Spot GPUs for pool ``model`` can (not) be had from now on."""
        return self._tell(now, SpotMarket(model, available))

    def standbys(self, now: float, model: str, standbys: tuple[Standby, ...]) -> None:
        self._report(now, Standbys(model, standbys))

    # -- start ----------------------------------------------------------------------------

    def attach(self, harness: FleetHarness) -> None:
        """Become ``harness``'s gate and routing; scrape the scraped pools every
        ``scrape_interval``; tell the controller of the replicas."""
        self._harness = harness
        harness.gate = self
        harness.routing = self
        if self._kv_names:
            harness.kv_hook = self.on_kv
            for driver in harness.drivers:
                driver.on_kv = self.on_kv
        now = harness.kernel.now
        if any(p.settings.scraped for p in self.control.pools.values()):
            harness.every(self.scrape_interval, self.scrape)
        for model in self.control.pools:
            self._report(now, self.replicas.seen(model))
        for start in self.control.fleet_rollouts():
            self._report(now, start)

    def scrape(self, now: float) -> None:
        """One scrape round: every scraped replica's metrics as of ``now`` (one that is
        down or blacked out keeps its last load)."""
        harness = self._harness
        assert harness is not None
        drivers = harness.drivers
        for model, pool in self.control.pools.items():
            if not pool.settings.scraped:
                continue
            loads = []
            for k in self.replicas.members(model):
                driver = drivers[k]
                if driver.down or k in self.blackout or k in self.hung:
                    continue
                running, waiting, usage = driver.load()
                replica = self.replicas.by_driver[k].id
                loads.append(ScrapedLoad(replica, running, waiting, usage))
            self._report(now, Scraped(model, tuple(loads)))
        self.scrapes += 1

    # -- the controller -------------------------------------------------------------------

    def _report(self, now: float, event: ControlEvent) -> None:
        """Hand the controller what the runtime or a scrape saw, where no caller takes events
        back: what its commands start (a held request routed to a replica that just became
        routable) is scheduled here."""
        events = self._tell(now, event)
        if events:
            harness = self._harness
            assert harness is not None
            harness.kernel.schedule_all(events)

    def _tell(self, now: float, event: ControlEvent) -> list[ScheduledEvent]:
        """Hand ``event`` to the controller and carry out what it says."""
        events = self._carry_out(now, self.control.handle(now, event))
        self._rewake(now)
        return events

    def _carry_out(  # noqa: PLR0912 - one case per command
        self, now: float, commands: list[Command]
    ) -> list[ScheduledEvent]:
        events: list[ScheduledEvent] = []
        for command in commands:
            match command:
                case Route() | Sleep() | WakeCommand() | Recall() if self._local:
                    # a replica's step end: their events are shared, scheduled from a
                    # shared Dispatch (another part may have run ahead of a sleep's end)
                    self._deferred.append(command)
                case Route(request_id=rid, replica=replica) if (
                    self.adapters is not None and self._loading(now, command)
                ):
                    pass  # it reaches its engine once the adapter is loaded there
                case Route(request_id=rid, replica=replica, resume=resume, priority=priority):
                    events += self._submit(now, int(rid), replica, resume, priority)
                case UnloadAdapter(replica=replica, adapter=adapter) if self.adapters is not None:
                    self.adapters.unload(replica, adapter)
                case Reject(request_id=rid, reason=reason, model=pool):
                    self._refuse(now, int(rid), pool)
                    if self._on_refuse is not None:
                        self._on_refuse(int(rid), reason)
                case Fallback():
                    pass  # counted by the controller; the request's next decision follows
                case Probe(model=model, replica=replica):
                    events += self._probe(now, model, replica)
                case Ejected(record=record):
                    self.ejections.append(record)
                case Scale():
                    if self.on_scale is not None:
                        self.on_scale(now, command)
                case RolloutStep(decision=decision):
                    self.rollout_log.append(decision)
                case Sleep() | WakeCommand():
                    self._reside(now, command)
                case KvResync():
                    events += self._resync(now, command)
                case Abandon(replica=replica, request_ids=ids):
                    events += self._abandon(now, replica, ids)
                case Recall(replica=replica, request_id=rid):
                    events += self._recall(now, replica, int(rid))
                case Replace():
                    if self.on_replace is not None:
                        events += self.on_replace(now, command)
        return events

    def _loading(self, now: float, route: Route) -> bool:
        """Whether ``route`` waits for an adapter load on its replica (its own, or one under
        way): then it is carried out when the load is done (without ``load``)."""
        adapters = self.adapters
        assert adapters is not None
        adapter = route.load or self._adapter_of.get(int(route.request_id))
        if adapter is None:
            return False
        ready = adapters.ready_at(now, route.replica, adapter, bool(route.load))
        if ready <= now:
            return False
        harness = self._harness
        assert harness is not None
        kernel = harness.kernel
        later = dataclasses.replace(route, load="")  # (replace is slow, but only loads pay it)
        kernel.schedule(max(ready, kernel.shared_floor()), URGENT, Dispatch(self, (later,)))
        return True

    def _abandon(
        self, now: float, replica: ReplicaId, ids: tuple[str, ...]
    ) -> list[ScheduledEvent]:
        """The controller abandons these requests' attempts on ``replica`` (it failed its
        checks): they leave its modelled engine as a cut connection does, and each reports
        ``AttemptFailed(TIMEOUT)``, as the gateway's timeout does (retried, or resumed)."""
        entry = self.replicas.by_id.get(replica)
        harness = self._harness
        if entry is None or entry.driver is None or harness is None:
            return []
        lost = harness.drivers[entry.driver].abandon(now, {int(rid) for rid in ids})
        return harness.lose(now, entry.driver, lost, Outcome.TIMEOUT)

    def _recall(self, now: float, replica: ReplicaId, index: int) -> list[ScheduledEvent]:
        """The controller recalls batch line ``index`` from ``replica`` (an interactive
        request needs its slot): it leaves the modelled engine as a cut connection does and
        reports ``AttemptFailed(CANCELLED)``, as the gateway does; it waits at the gate and
        runs again from its start (``submit_retry``) when routed."""
        entry = self.replicas.by_id.get(replica)
        harness = self._harness
        if entry is None or entry.driver is None or harness is None:
            return []
        self.recalls += 1
        lost = harness.drivers[entry.driver].abandon(now, {index})
        return harness.lose(now, entry.driver, lost, Outcome.CANCELLED, kept=True)

    def _probe(self, now: float, model: str, replica: ReplicaId) -> list[ScheduledEvent]:
        """Answered at once: ok unless the replica is down; a hung one's probe fails when
        its timeout (``health.active.timeout``) runs out, as the gateway's does."""
        entry = self.replicas.by_id.get(replica)
        ok = entry is not None and entry.state is ReplicaState.READY
        if ok and entry is not None and entry.driver is not None:
            if entry.driver in self.hung:
                timeout = self.control.pools[model].settings.health.active.timeout
                self._settle(now + timeout, ProbeAnswered(model, replica, False))
                return []
            harness = self._harness
            ok = harness is None or not harness.drivers[entry.driver].down
        return self._carry_out(now, self.control.handle(now, ProbeAnswered(model, replica, ok)))

    def _reside(self, now: float, command: Sleep | WakeCommand) -> None:
        """The modelled engine falls asleep (its prefix cache dropped) or wakes up; the
        controller hears of it when that is done (:class:`Later`)."""
        model, replica = command.model, command.replica
        if isinstance(command, Sleep):
            self._levels[replica] = command.level
            self.sleeps += 1
            entry = self.replicas.by_id.get(replica)
            harness = self._harness
            if entry is not None and entry.driver is not None and harness is not None:
                harness.drivers[entry.driver].model.reset_prefix_cache()
            settled = Resident(model, replica, asleep_at(command.level))
            self._settle(now + self._residency(model).sleep(command.level), settled)
            return
        took = self._residency(model).wake(self._levels.get(replica, 1))
        self.wake_seconds.append(took)
        self._settle(now + took, Resident(model, replica, Residency.SERVING))

    def _residency(self, pool: str) -> ResidencyTimes:
        """The modelled sleep and wake times of ``pool``'s replicas."""
        times = self._times.get(pool)
        if times is None:
            model = self.control.fleet.model(pool)
            assert model is not None, pool
            times = self._times[pool] = residency_times(
                get_model(model.served_model),
                get_gpu(model.gpu),
                parallel=Parallelism(tp=model.tp),
            )
        return times

    def _settle(self, at: float, event: ControlEvent) -> None:
        """Tell the controller ``event`` at ``at``."""
        harness = self._harness
        if harness is not None:
            harness.kernel.schedule(
                max(at, harness.kernel.shared_floor()), URGENT, Later(self, event)
            )

    def _resync(self, now: float, command: KvResync) -> list[ScheduledEvent]:
        """A modelled engine loses no batch and keeps none to replay: an empty answer (the
        index goes on from what it has)."""
        entry = self.replicas.by_id.get(command.replica)
        if entry is None or entry.incarnation is None:
            return []
        incarnation = str(entry.incarnation)
        answer = KvEvents(command.model, command.replica, incarnation, (), True)
        return self._carry_out(now, self.control.handle(now, answer))

    def _rewake(self, now: float) -> None:
        harness = self._harness
        if harness is None or not harness.active:
            return
        wake = self.control.next_wakeup()
        if wake is None:
            return
        at = max(wake, harness.kernel.shared_floor())
        if self._wake_at is None or at < self._wake_at or self._wake_at < now:
            self._wake_at = at
            harness.kernel.schedule(at, URGENT, Wake(self))

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        if isinstance(event, Dispatch):
            return self._carry_out(now, list(event.commands))
        if isinstance(event, Later):
            return self._tell(now, event.event)
        assert isinstance(event, Wake), event
        harness = self._harness
        if self._wake_at is None or now < self._wake_at or harness is None or not harness.active:
            return []
        self._wake_at = None
        if self.on_wake is not None:
            self.on_wake(now)
        return self._tell(now, Tick())

    # -- requests -------------------------------------------------------------------------

    def arrive(
        self, now: float, index: int, request: TraceRequest, prompt: tuple[int, ...]
    ) -> list[ScheduledEvent]:
        self.arrivals += 1
        model = self.model_of(request)
        hashes = self.control.served[model].hashes
        tenant, priority, weight = (
            (None, 0, 1.0) if self._tenant_of is None else self._tenant_of(index, request)
        )
        self._pending[index] = _Pending(request, prompt)
        if self.adapters is not None and self.control.served[model].adapter:
            self._adapter_of[index] = model
        size = self._kv_names.get(model)
        routed = RouteRequest(
            str(index),
            model,
            prefix_hashes=token_prefix_hashes(prompt) if hashes else (),
            prompt_tokens=len(prompt),
            session_key=request.session,
            tenant=tenant,
            # the replica is asked for exactly this many tokens (what its context must hold)
            max_tokens=request.output_tokens,
            block_hashes=() if size is None else block_hash_chain(prompt, size, KV_MAX_BLOCKS),
        )
        deadline = self._deadlines.get(tenant) if tenant is not None else None
        whole = tenant is not None and tenant in self._whole
        if whole:
            self._whole_ids.add(index)
        arrived = Arrived(routed, priority, weight, deadline, resumable=not whole, recallable=whole)
        return self._tell(now, arrived)

    def on_kv(self, now: float, replica: int, events: list[KvCacheEvent]) -> None:
        """Replica ``replica``'s prefix cache did this in a step (a local event): one batch
        for the controller, numbered per process as an engine numbers its batches."""
        entry = self.replicas.by_driver[replica]
        if entry.incarnation is None:
            return
        seq = self._kv_seq.get(replica, 0)
        self._kv_seq[replica] = seq + 1
        batch = KvBatch(seq, tuple(_kv_event(e) for e in events))
        event = KvEvents(entry.model, entry.id, str(entry.incarnation), (batch,))
        self._local = True
        try:
            self._tell(now, event)
        finally:
            self._local = False
        harness = self._harness
        if self._deferred and harness is not None:
            commands, self._deferred = tuple(self._deferred), []
            kernel = harness.kernel
            kernel.schedule(kernel.shared_floor(), URGENT, Dispatch(self, commands))

    def _submit(
        self, now: float, index: int, replica: ReplicaId, resume: bool = False, priority: int = 0
    ) -> list[ScheduledEvent]:
        """Carry out a Route of request ``index`` (``priority``: what its engine gets)."""
        harness = self._harness
        assert harness is not None
        entry = self.replicas.by_id[replica]
        k = entry.driver
        assert k is not None, replica
        if harness.drivers[k].down:  # it died this instant, before the runtime said so
            pending = self._pending.pop(index, None)
            if pending is not None:
                self.waits[index] = now - pending.request.arrival_s
                return harness.refused(now, index, k, pending.request, pending.prompt)
            return harness.refused(now, index, k)
        if resume:
            return harness.submit_resume(now, index, k)
        if k in self.erroring:  # a 5xx before any byte: the request stays where it was
            self.refused_attempts += 1
            return self._tell(now, AttemptFailed(entry.model, str(index), Outcome.REPLICA_ERROR))
        pending = self._pending.pop(index, None)
        if pending is not None:  # its first attempt
            request = pending.request
            self.waits[index] = now - request.arrival_s
            return harness.submit_new(now, index, request, pending.prompt, k, priority)
        return harness.submit_retry(now, index, k, priority)

    def _refuse(self, now: float, index: int, pool: str = "") -> None:
        """Request ``index`` ends without an answer; ``pool``: the one it was last in (empty:
        its served name's own)."""
        harness = self._harness
        assert harness is not None
        pending = self._pending.pop(index, None)
        if pending is not None:  # never reached a replica
            self.refused_pool[index] = pool or self.model_of(pending.request)
            harness.refuse(now, index, pending.request, len(pending.prompt))
            return
        harness.fail_lost(now, index)

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int | None:
        raise AssertionError("SimControl is the harness's gate: arrivals come through arrive()")

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None:
        """A request ended in replica ``replica`` (a step end: a local event)."""
        entry = self.replicas.by_driver[replica]
        entry.last_end = now
        work = None
        harness = self._harness
        log = None if harness is None else harness.recorder.log
        row = None
        if not rejected and log is not None and len(log):
            row = log[len(log) - 1]  # the driver appends a request's row, then tells on_end
            if row.index == index:
                work = (row.input_tokens - row.cached_tokens, row.output_tokens)
            else:
                row = None
        outcome = Outcome.CLIENT_ERROR if rejected else Outcome.SUCCESS
        self._local = True
        try:
            if row is not None and entry.model in self.control.rollouts.watched:
                ttft, tpot = row.ttft_s, row.tpot_s
                if ttft is not None:  # what the gateway measures, told as it tells it
                    itl = () if tpot is None else (tpot,)
                    self._tell(now, Latencies(entry.model, (ttft,), itl))
            ttft = None
            if self._timed and row is not None and outcome is Outcome.SUCCESS:
                ttft = row.ttft_s  # from its arrival, as the gateway measures it
            self._tell(now, Finished(entry.model, str(index), outcome, work, ttft))
        finally:
            self._local = False
        if self._deferred and harness is not None:
            commands, self._deferred = tuple(self._deferred), []
            kernel = harness.kernel
            kernel.schedule(kernel.shared_floor(), URGENT, Dispatch(self, commands))

    def on_lost(
        self,
        now: float,
        index: int,
        replica: int,
        started: bool,
        outcome: Outcome = Outcome.CONNECT_FAILURE,
    ) -> list[ScheduledEvent]:
        """Request ``index`` was lost in a crash of ``replica`` (a shared event): as live,
        its connection was reset (``CONNECT_FAILURE``: a gone replica, retried without the
        retry budget when it had no token yet); or its attempt was abandoned there
        (``TIMEOUT``, as the gateway reports one)."""
        model = self.replicas.by_driver[replica].model
        streamed = started and index not in self._whole_ids  # a whole answer sent nothing
        return self._tell(now, AttemptFailed(model, str(index), outcome, streamed=streamed))
