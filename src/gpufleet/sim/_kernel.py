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

An event is *shared* (the default) or *local*. A local event is one that only its target
reads or changes anything by (a replica's own step events); a shared one may read or change
any part (an arrival, which a router answers by reading every replica). The two kinds are
kept in two heaps and popped in the same one total order, so marking an event local changes
nothing about when it runs. It tells a part how far it may run ahead on its own:
``next_shared()`` is the time of the earliest pending shared event (or the end of the
current ``run(until)``), and until then nothing outside a part looks at it::

    local  heap   (0.004, 1, 9, StepEnd r2)  (0.011, 1, 12, StepEnd r0) ...
    shared heap   (0.180, 0, 17, Arrival #3)          next_shared() = 0.180
                   step() pops the smaller of the two heads

Two rules keep that promise true: a local event's handler schedules only local events, and
``schedule`` refuses a shared event earlier than a time ``next_shared()`` has returned (a part
may already be past it). A part that runs ahead leaves itself an event at or after the time
it reached, so when nothing is left to run, no part is ahead of ``now``.

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
    local: bool = False
    """Only ``event.target`` reads or changes anything by it (see ``Kernel.next_shared``)."""


class Kernel:
    """Discrete-event loop over a heap of ``(time, priority, seq, event)``."""

    __slots__ = ("_horizon", "_local", "_now", "_promised", "_seq", "_shared", "events_processed")

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"the kernel must start at a finite time, got {start}")
        self._now = start
        self._local: list[tuple[float, int, int, Event]] = []
        self._shared: list[tuple[float, int, int, Event]] = []
        self._seq = count()
        self._horizon = math.inf
        """The ``until`` of the ``run`` in progress (infinity outside one)."""
        self._promised = -math.inf
        """The latest time ``next_shared`` returned: parts may have run ahead to it."""
        self.events_processed = 0

    @property
    def now(self) -> float:
        """Virtual seconds: the time of the event being (or last) processed."""
        return self._now

    def __len__(self) -> int:
        """Events scheduled and not yet processed."""
        return len(self._local) + len(self._shared)

    def schedule(self, time: float, priority: int, event: Event, *, local: bool = False) -> None:
        """Deliver ``event`` to ``event.target`` at ``time`` (``ValueError`` if in the past).

        ``local``: only the target reads or changes anything by this event. A shared event
        earlier than a time ``next_shared`` has promised is refused too: a part may already
        have run past it.
        """
        if not self._now <= time < math.inf:  # also refuses NaN
            raise self._bad_time(time)
        if local:
            heappush(self._local, (time, priority, next(self._seq), event))
            return
        if time < self._promised:
            raise ValueError(
                f"cannot schedule a shared event at {time}: parts may have run ahead to "
                f"{self._promised} (next_shared() promised that nothing shared happens sooner)"
            )
        heappush(self._shared, (time, priority, next(self._seq), event))

    def _bad_time(self, time: float) -> ValueError:
        if time == math.inf:
            return ValueError("cannot schedule an event at infinity")
        return ValueError(f"cannot schedule an event at {time}: the kernel is at {self._now}")

    def schedule_all(self, events: Iterable[ScheduledEvent]) -> None:
        for scheduled in events:
            self.schedule(
                scheduled.time, scheduled.priority, scheduled.event, local=scheduled.local
            )

    def shared_floor(self) -> float:
        """The earliest time a shared event may be scheduled now: ``now``, or the latest
        time ``next_shared`` promised if a part may have run ahead to it. A part handling
        a local event that has something shared to do (a replica's step end that frees a
        place for a held request) schedules it here: at once when no part ran ahead, else
        at the instant the run-ahead reached (at most the next shared event)."""
        return max(self._now, self._promised)

    def peek(self) -> float:
        """Time of the next event; ``math.inf`` when nothing is scheduled."""
        local, shared = self._local, self._shared
        if local and (not shared or local[0] < shared[0]):
            return local[0][0]
        return shared[0][0] if shared else math.inf

    def next_shared(self) -> float:
        """The time before which nothing but a part itself reads or changes it: the earliest
        pending shared event, or the end of the ``run(until)`` in progress (``math.inf``
        when neither). A part handling a local event may apply its own future up to (not
        including) this time at once.
        """
        shared = self._shared
        horizon = shared[0][0] if shared and shared[0][0] < self._horizon else self._horizon
        self._promised = max(self._promised, horizon)
        return horizon

    def step(self) -> bool:
        """Process the next event; False when nothing is scheduled."""
        local, shared = self._local, self._shared
        if local and (not shared or local[0] < shared[0]):
            time, _, _, event = heappop(local)
            self._now = time
            self.events_processed += 1
            for scheduled in event.target.on_event(time, event):
                if not scheduled.local:
                    raise ValueError(
                        f"a local event ({type(event).__name__}) scheduled a shared one "
                        f"({type(scheduled.event).__name__}); only shared events may"
                    )
                then = scheduled.time
                if not time <= then < math.inf:  # schedule(), inlined for the hot path
                    raise self._bad_time(then)
                heappush(local, (then, scheduled.priority, next(self._seq), scheduled.event))
            return True
        if not shared:
            self._promised = -math.inf  # nothing is left, so no part is ahead of now
            return False
        time, _, _, event = heappop(shared)
        self._now = time
        self.events_processed += 1
        for scheduled in event.target.on_event(time, event):
            self.schedule(
                scheduled.time, scheduled.priority, scheduled.event, local=scheduled.local
            )
        return True

    def run(self, until: float | None = None) -> None:
        """Process events until none is left, or every event earlier than ``until``.

        With ``until``, the kernel then stands at ``until``: events at exactly ``until`` are
        still pending, so ``run(5); run(10)`` processes the same events as ``run(10)``.
        ``until`` bounds ``next_shared`` meanwhile: after ``run(until)`` returns, no part is
        ahead of ``until``, and the caller may look at or change any of them.
        """
        if until is None:
            while self.step():
                pass
            return
        if not until >= self._now:
            raise ValueError(f"cannot run until {until}: the kernel is already at {self._now}")
        self._horizon = until
        try:
            while self.peek() < until:
                self.step()
        finally:
            self._horizon = math.inf
        if until != math.inf:
            self._now = until
