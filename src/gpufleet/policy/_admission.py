"""Admission: a bounded queue in front of a saturated pool, strict priority classes, and
weighted fair sharing of GPU work across tenants within a class.

Pure and clock-injected; the gateway drives it live (futures, an asyncio timer), the
simulator in virtual time (events), both through one :class:`PoolAdmission` per pool::

    pool = PoolAdmission(config, model.max_num_seqs)
    if not pool.enter(ticket, routable):   # nobody waits and below saturation: started
        shed = pool.offer(now, ticket)     # tickets refused (the newcomer or a lower one)
    while t := pool.admit(now, routable):  start t       # at each arrival, end and tick
    pool.leave(t, (uncached_prompt_tokens, output_tokens))  # when t completes
    expired = pool.expire(now)             # every config.tick while queued: refuse them

Fairness is the virtual token counter of "Fairness in Serving Large Language Models"
(Sheng et al., OSDI 2024): every tenant has a counter of the service it got, divided by its
weight; the queue serves the backlogged tenant with the smallest counter. The service is GPU
work: ``uncached prompt tokens + output_weight × output tokens``, so a tenant whose prompts
hit the prefix cache pays less. A ticket is charged its estimated prompt when it starts and
corrected to the real work when it ends. A tenant that becomes backlogged has its counter
lifted to the smallest backlogged counter (or, with none, the counter the last started
ticket's tenant had), so credit cannot be banked while idle and spent as a burst that
starves the others.

Classes are strict: ``interactive`` (0) before ``batch`` (1). A full queue sheds the lowest
class first: the newest ticket, in the lowest class present (newcomer included), of the
tenant whose counter would be largest once its queued tickets in that class were served
(its counter plus their estimates over their weights; the newcomer on a tie). A light
tenant just served can have a larger counter than a heavy one for a moment; it is the
heavy tenant's long backlog that the queue is full of, so that is what goes.

Fair-share headroom (the reserve): at or above ``saturation`` a queued ticket waits for a
slot, however fair its place in the queue, and in a small pool a slot is a whole generation
away. So between ``saturation`` and ``reserve_saturation`` a ticket may still start if all
its tenant asks for (running + queued tickets) fits in the tenant's weighted fair share of
the pool's running requests (``weight / Σ active weights × running``; active: running or
queued here): max-min fairness, who asks for less than its share gets it at once. A light
tenant beside a heavy one starts at once; a tenant alone holds all that runs and asks for
more, so never uses the reserve; heavy tenants' backlogs never fit, so they cannot take
the reserve in turns. Only the highest class waiting may use it: batch never starts before
a queued interactive ticket. Above ``reserve_saturation`` everyone waits.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.fleet import ReplicaLoad, ReplicaView
from gpufleet.policy._autoscale_saturation import pool_utilisation, saturation

CLASSES = ("interactive", "batch")
"""Priority classes, highest first; a ticket's ``priority`` indexes this."""
BATCH = CLASSES.index("batch")
"""The lowest class: batch lines (docs/batch.md), gated on spare capacity."""


class AdmissionConfig(BaseModel):
    """The gateway's admission queue (fleet file ``tenants.admission``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    saturation: float = Field(1.0, gt=0.0)
    """A pool is saturated (requests queue at the gateway) at this
    :func:`~gpufleet.policy.saturation` (1.0: every replica holds what it can run)."""
    max_queue: int = Field(1024, ge=0)
    """Requests waiting at the gateway, over all tenants; a full queue sheds."""
    max_wait: float = Field(30.0, gt=0.0)
    """Default deadline: seconds a request may wait to start (a request's own
    ``x-gpufleet-deadline-ms`` may ask for less)."""
    output_weight: float = Field(2.0, ge=0.0)
    """An output token's cost in prompt tokens in the fair-share counter (VTC's w_q/w_p)."""
    tick: float = Field(0.05, gt=0.0)
    """Seconds between two looks at a non-empty queue (deadlines, and room only a scrape
    shows); the gateway's timer and the simulator's release events alike."""
    reserve_saturation: float = Field(1.0, ge=0.0)
    """Fair-share headroom: up to this saturation a request still starts at once if its
    tenant's running and queued requests fit in its weighted fair share of the pool's
    running requests (others wait from ``saturation``). At or below ``saturation`` (0 too):
    no reserve; so with the default ``saturation`` 1.0, none (the engines' batches are full
    there: a request above would only wait in one engine's FIFO queue)."""


def pool_saturated(
    routable: Sequence[ReplicaView],
    in_flight: int,
    config: AdmissionConfig,
    max_num_seqs: int,
    since_scrape: int = 0,
) -> bool:
    """Whether a pool's requests must queue: :func:`pool_level` at or above
    ``config.saturation``."""
    return pool_level(routable, in_flight, max_num_seqs, since_scrape) >= config.saturation


def pool_level(
    routable: Sequence[ReplicaView],
    in_flight: int,
    max_num_seqs: int,
    since_scrape: int = 0,
) -> float:
    """How full a pool is for admission: the shared saturation definition.

    The larger of the pool's :func:`pool_utilisation` from its replicas' last scrape and the
    admitting side's own count of requests let in (``in_flight``) spread over ``routable``
    (a scrape lags; the count does not), both against the pool's engines' ``max_num_seqs``
    (``ModelConfig.max_num_seqs``: its ``--max-num-seqs``). The scrape is
    moved by ``since_scrape``, the change of the own count since it was taken (requests
    started minus requests ended): without that, a scrape taken while the pool was full
    would hold every queued request back until the next scrape, though requests ended
    since. With no routable replica: 0 (nothing to wait for: routing refuses). The
    gateway's gate and the simulator's call this same function (through :class:`PoolGauge`).
    """
    if not routable:
        return 0.0
    seqs = max_num_seqs
    scraped = pool_utilisation(routable, seqs)
    if scraped is not None:
        scraped += since_scrape / (len(routable) * seqs)
    own = saturation(ReplicaLoad(in_flight=math.ceil(in_flight / len(routable))), seqs)
    return max(scraped or 0.0, own)


class PoolGauge:
    """One pool's :func:`pool_saturated`, remembering the own count at the latest scrape.

    A scrape is new when the latest ``observed_at`` of the routable replicas' loads moves;
    the own count then is the base that later changes are measured from.
    """

    __slots__ = ("_base", "_seen", "config", "max_num_seqs")

    def __init__(self, config: AdmissionConfig, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.config = config
        self.max_num_seqs = max_num_seqs
        """The pool's engines' running-batch cap (``ModelConfig.max_num_seqs``)."""
        self._seen: float | None = None
        self._base = 0

    def saturated(self, routable: Sequence[ReplicaView], in_flight: int) -> bool:
        return self.level(routable, in_flight) >= self.config.saturation

    def level(self, routable: Sequence[ReplicaView], in_flight: int) -> float:
        """:func:`pool_level`, the scrape moved by the own count since it."""
        seen = max(
            (r.load.observed_at for r in routable if r.load.observed_at is not None),
            default=None,
        )
        if seen != self._seen:
            self._seen = seen
            self._base = in_flight
        return pool_level(routable, in_flight, self.max_num_seqs, in_flight - self._base)


@dataclass(slots=True)
class Ticket:
    """One request waiting for (or holding) admission."""

    id: str
    tenant: str
    priority: int = 0
    weight: float = 1.0
    prompt_estimate: int = 0
    """Prompt tokens guessed before the response says (charged at start)."""
    deadline: float | None = None
    """Latest time it may start."""
    arrived: float = 0.0
    seq: int = field(default=0, compare=False)


class FairQueue:
    """The waiting tickets, every tenant's virtual token counter and running count."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}
        """Per tenant: tickets started (:meth:`start`) and not yet :meth:`end`-ed."""
        self._weights: dict[str, float] = {}
        """Per tenant: the weight of its latest ticket (for the fair share of the reserve)."""
        self._queues: list[dict[str, deque[Ticket]]] = [{} for _ in CLASSES]
        self._size = 0
        self._backlog: list[dict[str, float]] = [{} for _ in CLASSES]
        """Per class and tenant: the queued tickets' estimates over their weights."""
        self._seq = 0
        self._floor = 0.0

    def __len__(self) -> int:
        return self._size

    def waiting(self, tenant: str) -> int:
        return sum(len(q.get(tenant, ())) for q in self._queues)

    # -- arrivals ---------------------------------------------------------------------------

    def offer(self, now: float, ticket: Ticket) -> list[Ticket]:
        """Queue ``ticket``; the tickets shed to make room (possibly ``ticket`` itself)."""
        if not 0 <= ticket.priority < len(CLASSES):
            raise ValueError(f"priority must be in [0, {len(CLASSES)}), got {ticket.priority}")
        if ticket.deadline is not None and ticket.deadline < now:
            return [ticket]
        if self.config.max_queue == 0:
            return [ticket]
        shed: list[Ticket] = []
        if self._size >= self.config.max_queue:
            victim = self._victim(ticket)
            if victim is ticket:
                return [ticket]
            self._remove(victim)
            shed.append(victim)
        self._lift(ticket.tenant)
        self._weights[ticket.tenant] = ticket.weight
        self._seq += 1
        ticket.seq = self._seq
        self._queues[ticket.priority].setdefault(ticket.tenant, deque()).append(ticket)
        self._queued(ticket, 1)
        self._size += 1
        return shed

    def _lift(self, tenant: str) -> None:
        if self.waiting(tenant):
            return
        backlogged = [self.counters.get(t, 0.0) for q in self._queues for t in q]
        floor = min(backlogged) if backlogged else self._floor
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _victim(self, newcomer: Ticket) -> Ticket:
        lowest = max(
            [newcomer.priority, *(p for p, q in enumerate(self._queues) if q)],
        )
        backlog = self._backlog[lowest]
        best: Ticket | None = None
        best_projected = -1.0
        if newcomer.priority == lowest:
            best = newcomer
            best_projected = (
                self.counters.get(newcomer.tenant, 0.0)
                + backlog.get(newcomer.tenant, 0.0)
                + newcomer.prompt_estimate / newcomer.weight
            )
        for tenant, waiting in self._queues[lowest].items():
            projected = self.counters.get(tenant, 0.0) + backlog[tenant]
            if projected > best_projected:
                best, best_projected = waiting[-1], projected
        assert best is not None
        return best

    def _queued(self, ticket: Ticket, sign: int) -> None:
        backlog = self._backlog[ticket.priority]
        left = backlog.get(ticket.tenant, 0.0) + sign * ticket.prompt_estimate / ticket.weight
        if ticket.tenant in self._queues[ticket.priority]:
            backlog[ticket.tenant] = left
        else:
            backlog.pop(ticket.tenant, None)  # nothing queued: no rounding left behind

    def discard(self, ticket: Ticket) -> bool:
        """Take a waiting ticket out (its client left); whether it was waiting."""
        waiting = self._queues[ticket.priority].get(ticket.tenant)
        if waiting is None or ticket not in waiting:
            return False
        self._remove(ticket)
        return True

    def _remove(self, ticket: Ticket) -> None:
        queues = self._queues[ticket.priority]
        waiting = queues[ticket.tenant]
        waiting.remove(ticket)
        if not waiting:
            del queues[ticket.tenant]
        self._queued(ticket, -1)
        self._size -= 1

    # -- departures -------------------------------------------------------------------------

    def admit(self, now: float, level: float) -> Ticket | None:
        """The next ticket that may start (started: counted and charged) with the pool at
        saturation ``level`` (:meth:`PoolGauge.level`), or ``None``: below ``saturation``
        :meth:`pop`; below ``reserve_saturation`` :meth:`pop_reserve`; else nothing."""
        if level < self.config.saturation:
            return self.pop(now)
        if level < self.config.reserve_saturation:
            return self.pop_reserve(now)
        return None

    def pop(self, now: float) -> Ticket | None:
        """The next ticket to start: highest class, then smallest counter, then oldest."""
        del now  # the order does not depend on time; deadlines are :meth:`expire`'s
        for queues in self._queues:
            if queues:
                counters = self.counters
                return self._take(
                    queues, min(queues, key=lambda t: (counters.get(t, 0.0), queues[t][0].seq))
                )
        return None

    def pop_reserve(self, now: float) -> Ticket | None:
        """The next ticket that may start in the reserve: in the highest class waiting, of a
        tenant whose running and queued tickets fit in its weighted fair share of the running
        ones (:meth:`under_share`); smallest counter, then oldest, among those."""
        del now
        for queues in self._queues:
            if not queues:
                continue
            counters = self.counters
            under = [t for t in queues if self.under_share(t)]
            if not under:
                return None  # a lower class never jumps a waiting higher one
            return self._take(
                queues, min(under, key=lambda t: (counters.get(t, 0.0), queues[t][0].seq))
            )
        return None

    def under_share(self, tenant: str) -> bool:
        """Whether all ``tenant`` asks for, its running and queued tickets, fits in its
        weighted fair share of the running tickets: ``weight / W × running`` over the active
        tenants (running or queued here; ``W`` their weights' sum).

        Its whole demand, not its running count: a heavy tenant's backlog never fits, so
        heavy tenants cannot climb into the reserve by taking turns a request below their
        share; a light tenant's does. A tenant alone holds everything running and asks for
        more: never under. It is max-min fairness: who asks for less than its share gets it.
        """
        weights = self._weights
        active = set(self.running)
        for queues in self._queues:
            active.update(queues)
        active.add(tenant)
        total_weight = sum(weights.get(t, 1.0) for t in active)
        share = weights.get(tenant, 1.0) / total_weight * sum(self.running.values())
        # A hair of slack for the float division: 1/3 × 3 must count as 1.
        return self.running.get(tenant, 0) + self.waiting(tenant) <= share + 1e-9

    def _take(self, queues: dict[str, deque[Ticket]], tenant: str) -> Ticket:
        waiting = queues[tenant]
        ticket = waiting.popleft()
        if not waiting:
            del queues[tenant]
        self._queued(ticket, -1)
        self._size -= 1
        self.start(ticket)
        return ticket

    def start(self, ticket: Ticket) -> None:
        """A ticket started (by :meth:`pop`, or directly by a caller): count it running and
        charge it its estimate."""
        counter = self.counters.get(ticket.tenant, 0.0) + ticket.prompt_estimate / ticket.weight
        self.counters[ticket.tenant] = counter
        self._floor = counter
        self.running[ticket.tenant] = self.running.get(ticket.tenant, 0) + 1
        self._weights[ticket.tenant] = ticket.weight

    def end(self, ticket: Ticket, work: tuple[int, int] | None = None) -> None:
        """A started ticket ended: no longer running; ``work`` (uncached prompt, output
        tokens), when known, replaces its estimate (:meth:`charge`)."""
        left = self.running.get(ticket.tenant, 0) - 1
        if left > 0:
            self.running[ticket.tenant] = left
        else:
            self.running.pop(ticket.tenant, None)
        if work is not None:
            self.charge(ticket, *work)

    def charge(self, ticket: Ticket, uncached_prompt: int, output: int) -> None:
        """Replace a started ticket's estimate with the work it really cost (its running
        count is :meth:`end`'s)."""
        work = uncached_prompt + self.config.output_weight * output - ticket.prompt_estimate
        self.counters[ticket.tenant] = self.counters.get(ticket.tenant, 0.0) + work / ticket.weight

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the queued tickets whose deadline passed."""
        gone = [
            t
            for queues in self._queues
            for waiting in queues.values()
            for t in waiting
            if t.deadline is not None and t.deadline < now
        ]
        for ticket in gone:
            self._remove(ticket)
        return gone

    def next_deadline(self) -> float | None:
        deadlines = [
            t.deadline
            for queues in self._queues
            for waiting in queues.values()
            for t in waiting
            if t.deadline is not None
        ]
        return min(deadlines, default=None)


class PoolAdmission:
    """One pool's admission, the state machine both shells drive: its :class:`FairQueue`,
    its :class:`PoolGauge` and the count of tickets it let in (``in_flight``).

    A ticket starts at once (:meth:`enter`) if nobody waits and the pool is below
    ``saturation``; otherwise it is :meth:`offer`-ed to the queue. The shell then pumps
    (:meth:`admit` until ``None``) at that arrival, whenever a started ticket :meth:`leave`-s
    and every ``config.tick`` while the queue is non-empty, after :meth:`expire`. A started
    ticket is counted in flight until :meth:`leave`. ``routable`` is the pool's routable
    replicas as the shell sees them at that moment (the gauge moves its last scrape by the
    own count since).
    """

    __slots__ = ("config", "gauge", "in_flight", "queue", "queue_max")

    def __init__(self, config: AdmissionConfig, max_num_seqs: int) -> None:
        self.config = config
        self.queue = FairQueue(config)
        self.gauge = PoolGauge(config, max_num_seqs)
        self.in_flight = 0
        self.queue_max = 0
        """The longest the queue has been."""

    def level(self, routable: Sequence[ReplicaView]) -> float:
        return self.gauge.level(routable, self.in_flight)

    def saturated(self, routable: Sequence[ReplicaView]) -> bool:
        # No routable replica: not saturated (nothing to wait for: routing refuses).
        return self.gauge.saturated(routable, self.in_flight)

    def enter(self, ticket: Ticket, routable: Sequence[ReplicaView]) -> bool:
        """Start ``ticket`` at once (counted, charged) if nobody waits and the pool is not
        saturated; ``False``: it must be :meth:`offer`-ed."""
        if self.queue or self.saturated(routable):
            return False
        self.queue.start(ticket)
        self.in_flight += 1
        return True

    def offer(self, now: float, ticket: Ticket) -> list[Ticket]:
        """Queue ``ticket``; the tickets shed to make room (possibly ``ticket`` itself)."""
        shed = self.queue.offer(now, ticket)
        self.queue_max = max(self.queue_max, len(self.queue))
        return shed

    def admit(self, now: float, routable: Sequence[ReplicaView]) -> Ticket | None:
        """The next queued ticket that may start now (started: counted in flight and
        charged; :meth:`FairQueue.admit` at the pool's level), or ``None``."""
        if not self.queue:
            return None
        ticket = self.queue.admit(now, self.level(routable))
        if ticket is not None:
            self.in_flight += 1
        return ticket

    def leave(self, ticket: Ticket, work: tuple[int, int] | None) -> None:
        """A started ticket ended (or never ran); ``work`` = (uncached prompt, output
        tokens) if known. Pump after: a queued ticket may start."""
        self.in_flight -= 1
        self.queue.end(ticket, work)

    def discard(self, ticket: Ticket) -> bool:
        """Take a queued ticket out (its client left); whether it was queued."""
        return self.queue.discard(ticket)

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the queued tickets whose deadline passed (refuse them)."""
        return self.queue.expire(now)
