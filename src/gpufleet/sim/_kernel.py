"""The event kernel: a heap of timed events, popped in a total order, dispatched to parts.

A simulated part is a plain object with one method, ``on_event(now, event)``, that returns
the events it wants to happen next. The kernel owns virtual time and nothing else::

    kernel = Kernel()
    kernel.schedule(0.0, NORMAL, Ping(target=pinger))
    kernel.run(until=10.0)          # every event with time < 10, then now = 10

    heap entry  (time, priority, seq, event)      popped smallest first
                  │      │        │
                  │      │        └─ scheduling order: equal (time, priority) keep FIFO order,
                  │      │           so a run never depends on how the heap breaks ties
                  │      └────────── lower runs first at equal times (arrivals before steps)
                  └───────────────── virtual seconds; never earlier than ``now``

Events are values addressed to a part (``event.target``); the kernel never looks inside
them. Nothing here reads a wall clock: a real-time variant would override only ``step()``
to wait for the wall clock to reach the next event's time (SimPy's ``rt.py`` shape).
docs/design/sim-kernel.md explains the choices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import count
from typing import Protocol

URGENT = 0
"""Priority of events that must precede everything else at the same time."""
NORMAL = 1
"""The default priority."""


class Part(Protocol):
    """A simulated part: it reacts to an event and says what happens next."""

    def on_event(self, now: float, event: Event) -> Iterable[ScheduledEvent]: ...


class Event(Protocol):
    """A message to one part; any object with a ``target`` will do (a frozen dataclass)."""

    @property
    def target(self) -> Part: ...


@dataclass(frozen=True, slots=True)
class ScheduledEvent:
    """``event`` to be delivered at ``time`` with ``priority`` (what ``on_event`` returns)."""

    time: float
    priority: int
    event: Event


class KernelClock:
    """Read-only virtual time: the ``now()`` and ``time_scale`` of the engine's ``Clock``.

    Parts that want to wait return a :class:`ScheduledEvent` instead of sleeping, so this
    clock has no ``sleep_until``.
    """

    __slots__ = ("_kernel",)

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel

    @property
    def time_scale(self) -> float:
        """Virtual seconds per wall second: unbounded (the kernel jumps from event to event)."""
        return math.inf

    def now(self) -> float:
        return self._kernel.now


class Kernel:
    """Discrete-event loop over a heap of ``(time, priority, seq, event)``."""

    __slots__ = ("_heap", "_now", "_seq", "events_processed")

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"the kernel must start at a finite time, got {start}")
        self._now = start
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = count()
        self.events_processed = 0

    @property
    def now(self) -> float:
        """Virtual seconds: the time of the event being (or last) processed."""
        return self._now

    @property
    def clock(self) -> KernelClock:
        return KernelClock(self)

    def __len__(self) -> int:
        """Events scheduled and not yet processed."""
        return len(self._heap)

    def schedule(self, time: float, priority: int, event: Event) -> None:
        """Deliver ``event`` to ``event.target`` at ``time`` (``ValueError`` if in the past)."""
        if not time >= self._now:  # also refuses NaN
            raise ValueError(f"cannot schedule an event at {time}: the kernel is at {self._now}")
        if time == math.inf:
            raise ValueError("cannot schedule an event at infinity")
        heappush(self._heap, (time, priority, next(self._seq), event))

    def schedule_all(self, events: Iterable[ScheduledEvent]) -> None:
        for scheduled in events:
            self.schedule(scheduled.time, scheduled.priority, scheduled.event)

    def peek(self) -> float:
        """Time of the next event; ``math.inf`` when nothing is scheduled."""
        return self._heap[0][0] if self._heap else math.inf

    def step(self) -> bool:
        """Process the next event; False when nothing is scheduled."""
        if not self._heap:
            return False
        time, _, _, event = heappop(self._heap)
        self._now = time
        self.events_processed += 1
        for scheduled in event.target.on_event(time, event):
            self.schedule(scheduled.time, scheduled.priority, scheduled.event)
        return True

    def run(self, until: float | None = None) -> None:
        """Process events until none is left, or every event earlier than ``until``.

        With ``until``, the kernel then stands at ``until``: events at exactly ``until`` are
        still pending, so ``run(5); run(10)`` processes the same events as ``run(10)``.
        """
        if until is None:
            while self.step():
                pass
            return
        if not until >= self._now:
            raise ValueError(f"cannot run until {until}: the kernel is already at {self._now}")
        heap = self._heap
        while heap and heap[0][0] < until:
            self.step()
        if until != math.inf:
            self._now = until
