"""Tenants and the gateway's admission queue in the simulator: the same ``FairQueue``.

The gateway (``gpufleet.gateway._admission``) lets a request start at once while its pool is
not saturated and nobody waits; otherwise the request waits in the pool's
:class:`~gpufleet.policy.FairQueue` (strict classes, fair share of GPU work between tenants,
bounded, deadlines), through one :class:`~gpufleet.policy.PoolAdmission` per pool (when to
start at once, to queue, to pump and to expire). :class:`SimAdmission` drives that same
pure state machine in virtual time, in front of the fleet's routers, keeping only its
events::

    Arrival ─► tenant (the trace's, or drawn from the mix) ─► ticket
            ─► pool not saturated and nobody waits? ─► start: route + submit now
            └► offer(ticket) ─► shed? an error row (the gateway's 503)
                            └► pump: admit(level) ─► start (at once: fair-share reserve)
                            └► waits ─► Release tick: expire (503) · pump: admit ─► start
    end     ─► end(ticket, (uncached prompt, output))   in-flight count − 1

What the gate reads is what the gateway's reads, with the same staleness:
:func:`~gpufleet.policy.pool_saturated` (through a :class:`~gpufleet.policy.PoolGauge`)
over the routing view rebuilt at each scrape (``gateway.scrape_interval``; admission makes
every pool scraped) and the gate's own count of the requests it let in. When it looks is
the gateway's too: at each arrival, the instant a request ends (a :class:`Release` at that
very time), and every ``admission.tick`` (50 ms, the gateway's) while a queue is non-empty, for
deadlines and for room that only a scrape shows. A start at the instant of another
replica's step end needs every replica at that instant, so with admission on the replicas
do not fast-forward (``FleetSimulation`` turns ``fast_forward`` off; under saturation
arrivals and ends leave little to skip anyway).

A ticket's prompt estimate is the exact prompt length (the gateway guesses it from the
text); at the end it is charged its real work: uncached prompt tokens (the replica's prefix
cache hits come off) plus ``output_weight`` × output tokens, as the gateway charges from the
response's usage.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any, Final

from gpufleet.policy import CLASSES, AdmissionConfig, PoolAdmission, PoolGauge, Ticket
from gpufleet.sim._kernel import URGENT, Event, ScheduledEvent
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._traces import TraceRequest

if TYPE_CHECKING:
    from gpufleet.sim._harness import FleetHarness
    from gpufleet.sim._policy import PolicyRouting
    from gpufleet.sim._recorder import RequestLog

ANONYMOUS: Final = "anonymous"
"""The tenant of a request that names none when no mix is given (the gateway's auth-off)."""

_UNSTARTED = math.nan
"""Queue wait of a request that never started (shed, expired)."""


@dataclass(frozen=True, slots=True)
class SimTenant:
    """A tenant as the simulator knows it: what the store holds live, plus its share of a
    trace whose requests name no tenant."""

    name: str
    share: float = 1.0
    """Relative share of the trace's requests that name no tenant (drawn per request)."""
    weight: float = 1.0
    """Fair-share weight (``gpufleet keys create --weight``)."""
    priority: str = "interactive"
    """Priority class (``--priority``): ``interactive`` or ``batch``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not (math.isfinite(self.share) and self.share >= 0):
            raise ValueError(f"tenant {self.name!r}: share must be >= 0, got {self.share}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.priority not in CLASSES:
            raise ValueError(
                f"tenant {self.name!r}: priority must be one of {', '.join(CLASSES)}, "
                f"got {self.priority!r}"
            )


def parse_tenant(spec: str) -> SimTenant:
    """``NAME[:share=S,weight=W,priority=P]``, the ``--tenant`` option of ``simulate``.

    ``heavy:share=10`` draws ten times as many of a trace's untagged requests for ``heavy``
    as for a tenant of share 1; ``batch-team:priority=batch,weight=2``.
    """
    name, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--tenant {spec!r}: {item!r} is not key=value")
        if key in {"share", "weight"}:
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"--tenant {spec!r}: {key} {value!r} is not a number") from None
        elif key == "priority":
            fields[key] = value
        else:
            raise ValueError(f"--tenant {spec!r}: unknown key {key!r} (share, weight, priority)")
    return SimTenant(name.strip(), **fields)


class TenantMix:
    """Who sent each request: the trace's ``tenant`` field, else a draw by share.

    Draws come from ``Random("gpufleet-tenants-<seed>")``, one per untagged request in
    arrival order, so a seeded run assigns the same tenants every time.
    """

    __slots__ = ("_cumulative", "_names", "_rng", "tenants")

    def __init__(self, tenants: Sequence[SimTenant], seed: int) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) < len(names):
            raise ValueError(f"tenant names repeat: {', '.join(names)}")
        self.tenants = {t.name: t for t in tenants}
        drawn = [t for t in tenants if t.share > 0]
        self._names = [t.name for t in drawn]
        total = math.fsum(t.share for t in drawn)
        running = 0.0
        self._cumulative: list[float] = []
        for t in drawn:
            running += t.share / total
            self._cumulative.append(running)
        self._rng = Random(f"gpufleet-tenants-{seed}")

    def tenant_of(self, request: TraceRequest) -> str:
        if request.tenant is not None:
            return request.tenant
        names = self._names
        if not names:
            return ANONYMOUS
        if len(names) == 1:
            return names[0]
        draw = self._rng.random()
        for name, edge in zip(names, self._cumulative, strict=True):
            if draw < edge:
                return name
        return names[-1]

    def settings(self, tenant: str) -> SimTenant:
        """A tenant's weight and class (a tenant the mix does not name: weight 1, interactive)."""
        known = self.tenants.get(tenant)
        return known if known is not None else SimTenant(tenant)


@dataclass(frozen=True, slots=True)
class Release:
    """Look at the non-empty queues: start what has room (``periodic``: the tick, which
    also expires deadlines and sets the next tick)."""

    target: SimAdmission
    periodic: bool = True


@dataclass(slots=True)
class _Held:
    index: int
    request: TraceRequest
    prompt: tuple[int, ...]
    pool: str


class SimAdmission:
    """The harness's gate (``FleetHarness.gate``) and a :class:`~gpufleet.sim.Routing` around
    the fleet's :class:`~gpufleet.sim.PolicyRouting` (to hear of every end).

    ``enabled=False`` keeps only the bookkeeping: every request starts at once (the engines'
    own FIFO queues), and the report still has each tenant's latencies (the contrast).
    """

    __slots__ = (
        "_armed",
        "_ended_at",
        "_gates",
        "_harness",
        "_held",
        "_log",
        "_names",
        "_started",
        "arrived",
        "config",
        "enabled",
        "expired",
        "inner",
        "mix",
        "shed",
        "tenant_ids",
        "tick",
        "waits",
    )

    def __init__(
        self,
        inner: PolicyRouting,
        config: AdmissionConfig,
        mix: TenantMix,
        max_num_seqs: Mapping[str, int],
        *,
        enabled: bool = True,
    ) -> None:
        self.inner = inner
        self.config = config
        self.mix = mix
        self.enabled = enabled
        self.tick = config.tick
        """Simulated seconds between two looks at a non-empty queue (the gateway's)."""
        self._gates = {
            name: PoolAdmission(config, max_num_seqs[name]) for name in inner.pool_names()
        }
        self._harness: FleetHarness | None = None
        self._log: RequestLog | None = None
        self._armed = False
        self._ended_at = -math.inf
        """The time of the last end-of-request release scheduled (one per instant)."""
        self._held: dict[str, _Held] = {}
        self._started: dict[int, tuple[Ticket, str]] = {}
        self._names: dict[str, int] = {}
        self.arrived = 0
        """Requests that reached the gateway (queued ones included)."""
        self.tenant_ids = array("H")
        """Per arrived request (by index): its tenant, as an index into :meth:`tenants`."""
        self.waits = array("d")
        """Per arrived request: seconds queued at the gateway (NaN: never started)."""
        self.shed: dict[str, int] = {}
        """Per tenant: requests a full queue shed (503)."""
        self.expired: dict[str, int] = {}
        """Per tenant: requests still queued at their deadline (503)."""

    def attach(self, harness: FleetHarness) -> None:
        """Become ``harness``'s gate and routing (call before it starts)."""
        self._harness = harness
        self._log = harness.recorder.log
        harness.gate = self
        harness.routing = self

    def gauge(self, pool: str) -> PoolGauge:
        """``pool``'s saturation gauge (its ``max_num_seqs`` is the pool's engines')."""
        return self._gates[pool].gauge

    def tenants(self) -> list[str]:
        """Tenant names, in order of first arrival (``tenant_ids`` index them)."""
        return list(self._names)

    # -- the gate -------------------------------------------------------------------------

    def arrive(
        self, now: float, index: int, request: TraceRequest, prompt: tuple[int, ...]
    ) -> list[ScheduledEvent]:
        harness = self._harness
        assert harness is not None, "attach() first"
        tenant = self.mix.tenant_of(request)
        tid = self._names.setdefault(tenant, len(self._names))
        self.tenant_ids.append(tid)
        self.waits.append(_UNSTARTED)
        self.arrived += 1
        if not self.enabled:
            self.waits[index] = 0.0
            return harness.dispatch(now, index, request, prompt)
        settings = self.mix.settings(tenant)
        pool = self.inner.pool_of(request)
        gate = self._gates[pool]
        ticket = Ticket(
            str(index),
            tenant,
            priority=CLASSES.index(settings.priority),
            weight=settings.weight,
            prompt_estimate=len(prompt),
            deadline=now + self.config.max_wait,
            arrived=now,
        )
        if gate.enter(ticket, self.inner.view.routable(pool)):
            return self._start(now, pool, ticket, _Held(index, request, prompt, pool))
        self._held[ticket.id] = _Held(index, request, prompt, pool)
        for shed in gate.offer(now, ticket):
            self._refuse(now, shed, self.shed)
        events = self._pump(now, pool, gate)
        if not self._armed and gate.queue:
            self._armed = True
            harness.kernel.schedule(now + self.tick, URGENT, Release(self))
        return events

    def _start(self, now: float, pool: str, ticket: Ticket, held: _Held) -> list[ScheduledEvent]:
        """A ticket the gate started (counted in flight): route and submit it now."""
        harness = self._harness
        assert harness is not None
        self._started[held.index] = (ticket, pool)
        self.waits[held.index] = now - ticket.arrived
        return harness.dispatch(now, held.index, held.request, held.prompt)

    def _pump(self, now: float, pool: str, gate: PoolAdmission) -> list[ScheduledEvent]:
        events: list[ScheduledEvent] = []
        routable = self.inner.view.routable
        while (ticket := gate.admit(now, routable(pool))) is not None:
            events += self._start(now, pool, ticket, self._held.pop(ticket.id))
        return events

    def _refuse(self, now: float, ticket: Ticket, counts: dict[str, int]) -> None:
        harness = self._harness
        assert harness is not None
        held = self._held.pop(ticket.id)
        counts[ticket.tenant] = counts.get(ticket.tenant, 0) + 1
        self.inner.refused_pool[held.index] = held.pool
        harness.refuse(now, held.index, held.request, len(held.prompt))

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, Release), event
        events: list[ScheduledEvent] = []
        for pool, gate in self._gates.items():
            if not gate.queue:
                continue
            if event.periodic:
                for ticket in gate.expire(now):
                    self._refuse(now, ticket, self.expired)
            events += self._pump(now, pool, gate)
        if not event.periodic:
            return events
        self._armed = False
        if any(gate.queue for gate in self._gates.values()):
            self._armed = True
            events.append(ScheduledEvent(now + self.tick, URGENT, Release(self)))
        return events

    # -- the routing seam (what the harness tells its routing) ----------------------------

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int | None:
        chosen = self.inner.route(now, index, request, prompt, replicas)
        if chosen is None:
            self._leave(now, index, None)  # the router's 503: it was let in and is gone
        return chosen

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None:
        work = None
        log = self._log
        if not rejected and log is not None and len(log):
            row = log[len(log) - 1]  # the driver appends a request's row, then tells on_end
            if row.index == index:
                work = (row.input_tokens - row.cached_tokens, row.output_tokens)
        self._leave(now, index, work)
        self.inner.on_end(now, index, replica, rejected)

    def on_lost(self, now: float, index: int, replica: int, started: bool) -> int | None:
        retry = self.inner.on_lost(now, index, replica, started)
        if retry is None:
            self._leave(now, index, None)
        return retry

    def _leave(self, now: float, index: int, work: tuple[int, int] | None) -> None:
        """A started request ended: the count drops, its work is charged, and a queued one
        may start at this instant (the gateway's ``leave`` pumps at once)."""
        started = self._started.pop(index, None)
        if started is None:
            return
        ticket, pool = started
        gate = self._gates[pool]
        gate.leave(ticket, work)
        harness = self._harness
        if gate.queue and harness is not None and self._ended_at != now:
            # Called from a replica's step end (a local event): legal as a shared event at
            # this instant only because no replica runs ahead while admission is on.
            self._ended_at = now
            harness.kernel.schedule(now, URGENT, Release(self, periodic=False))

    # -- the report -----------------------------------------------------------------------

    def report(
        self,
        log: RequestLog,
        quantiles: Callable[[Sequence[float]], dict[str, float | None]],
        rounded: Callable[[float | None], float | None],
    ) -> dict[str, Any]:
        """Each tenant's latencies, queue waits and refusals (report.json ``tenants``)."""
        names = self.tenants()
        ids = self.tenant_ids
        ttft: list[list[float]] = [[] for _ in names]
        e2e: list[list[float]] = [[] for _ in names]
        requests = [0] * len(names)
        served = [0] * len(names)
        failed = [0] * len(names)
        rejected = [0] * len(names)
        output = [0] * len(names)
        for record in log:
            t = ids[record.index]
            requests[t] += 1
            if record.rejected:
                rejected[t] += 1
            elif record.failed:
                failed[t] += 1
            else:
                served[t] += 1
                ttft[t].append(record.ttft_s or 0.0)
                e2e[t].append(record.e2e_s)
                output[t] += record.output_tokens
        waits: list[list[float]] = [[] for _ in names]
        queued = [0] * len(names)
        for t, wait in zip(ids, self.waits, strict=True):
            if not math.isnan(wait):
                waits[t].append(wait)
                queued[t] += wait > 0
        tenants: dict[str, Any] = {}
        for t, name in sorted(enumerate(names), key=lambda item: item[1]):
            settings = self.mix.settings(name)
            for values in (ttft[t], e2e[t], waits[t]):
                values.sort()
            tenants[name] = {
                "weight": settings.weight,
                "priority": settings.priority,
                "requests": requests[t],
                "served": served[t],
                "rejected": rejected[t],
                "failed": failed[t],
                "queued": queued[t],
                "shed": self.shed.get(name, 0),
                "expired": self.expired.get(name, 0),
                "output_tokens": output[t],
                "ttft_s": quantiles(ttft[t]),
                "e2e_s": quantiles(e2e[t]),
                "queue_wait_s": quantiles(waits[t]),
            }
        config = self.config
        return {
            "admission": {
                "on": self.enabled,
                "saturation": config.saturation,
                "max_num_seqs": {
                    pool: gate.gauge.max_num_seqs for pool, gate in self._gates.items()
                },
                "max_queue": config.max_queue,
                "max_wait_s": config.max_wait,
                "output_weight": config.output_weight,
                "reserve_saturation": config.reserve_saturation,
                "release_tick_s": self.tick,
                "queue_max": {pool: gate.queue_max for pool, gate in self._gates.items()},
                "counters": {
                    pool: {
                        name: rounded(value) for name, value in sorted(gate.queue.counters.items())
                    }
                    for pool, gate in self._gates.items()
                },
            },
            "tenants": tenants,
        }
