"""Admission: a bounded queue in front of a saturated pool, strict priority classes, and
weighted fair sharing of GPU work across tenants within a class.

Pure and clock-injected; the gateway feeds it live, the simulator in virtual time::

    queue = FairQueue(AdmissionConfig())
    shed = queue.offer(now, ticket)        # tickets refused (the newcomer or a lower one)
    while not saturated and (t := queue.pop(now)):  start t
    queue.charge(t, uncached_prompt_tokens, output_tokens)   # when t completes
    expired = queue.expire(now)            # deadlines passed while queued: refuse them

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
tenant with the largest counter (the newcomer on a tie).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

CLASSES = ("interactive", "batch")
"""Priority classes, highest first; a ticket's ``priority`` indexes this."""


class AdmissionConfig(BaseModel):
    """The gateway's admission queue (fleet file ``tenants.admission``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    saturation: float = Field(1.0, gt=0.0)
    """A pool is saturated (requests queue at the gateway) at this
    :func:`~gpufleet.policy.saturation` (1.0: every replica holds what it can run)."""
    max_num_seqs: int = Field(256, ge=1)
    """The engines' running-batch cap (vLLM's ``--max-num-seqs``), for saturation."""
    max_queue: int = Field(1024, ge=0)
    """Requests waiting at the gateway, over all tenants; a full queue sheds."""
    max_wait: float = Field(30.0, gt=0.0)
    """Default deadline: seconds a request may wait to start (a request's own
    ``x-gpufleet-deadline-ms`` may ask for less)."""
    output_weight: float = Field(2.0, ge=0.0)
    """An output token's cost in prompt tokens in the fair-share counter (VTC's w_q/w_p)."""


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
    """The waiting tickets and every tenant's virtual token counter."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.counters: dict[str, float] = {}
        self._queues: list[dict[str, deque[Ticket]]] = [{} for _ in CLASSES]
        self._size = 0
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
        self._seq += 1
        ticket.seq = self._seq
        self._queues[ticket.priority].setdefault(ticket.tenant, deque()).append(ticket)
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
        best = newcomer if newcomer.priority == lowest else None
        best_counter = self.counters.get(newcomer.tenant, 0.0) if best is not None else -1.0
        for tenant, waiting in self._queues[lowest].items():
            counter = self.counters.get(tenant, 0.0)
            if counter > best_counter:
                best, best_counter = waiting[-1], counter
        assert best is not None
        return best

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
        self._size -= 1

    # -- departures -------------------------------------------------------------------------

    def pop(self, now: float) -> Ticket | None:
        """The next ticket to start: highest class, then smallest counter, then oldest."""
        del now  # the order does not depend on time; deadlines are :meth:`expire`'s
        for queues in self._queues:
            if not queues:
                continue
            counters = self.counters
            tenant = min(queues, key=lambda t: (counters.get(t, 0.0), queues[t][0].seq))
            waiting = queues[tenant]
            ticket = waiting.popleft()
            if not waiting:
                del queues[tenant]
            self._size -= 1
            self.start(ticket)
            return ticket
        return None

    def start(self, ticket: Ticket) -> None:
        """Charge a ticket started (by :meth:`pop`, or directly by a caller) its estimate."""
        counter = self.counters.get(ticket.tenant, 0.0) + ticket.prompt_estimate / ticket.weight
        self.counters[ticket.tenant] = counter
        self._floor = counter

    def charge(self, ticket: Ticket, uncached_prompt: int, output: int) -> None:
        """A started ticket completed: replace its estimate with the work it really cost."""
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
