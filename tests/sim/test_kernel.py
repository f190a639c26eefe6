"""The event kernel: total order over (time, priority, seq), run(until), the clock."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.sim import NORMAL, URGENT, Event, Kernel, ScheduledEvent


@dataclass(frozen=True, slots=True)
class Note:
    """An event that, when delivered, may schedule children ``delay`` later."""

    target: Recorder
    name: int
    children: tuple[tuple[float, int, int], ...] = ()
    """(delay, priority, name) of the events to schedule on delivery."""


@dataclass
class Recorder:
    seen: list[tuple[float, int, int]] = field(default_factory=list)

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, Note)
        self.seen.append((now, event.name, len(self.seen)))
        return [
            ScheduledEvent(now + delay, priority, Note(self, name))
            for delay, priority, name in event.children
        ]


times = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.5, 7.0])  # few values: many ties
priorities = st.integers(min_value=0, max_value=2)


@given(st.lists(st.tuples(times, priorities), max_size=60))
def test_events_pop_in_time_priority_then_scheduling_order(
    schedule: list[tuple[float, int]],
) -> None:
    recorder = Recorder()
    kernel = Kernel()
    for name, (time, priority) in enumerate(schedule):
        kernel.schedule(time, priority, Note(recorder, name))
    kernel.run()
    expected = sorted(range(len(schedule)), key=lambda n: (*schedule[n], n))
    assert [name for _, name, _ in recorder.seen] == expected
    assert kernel.events_processed == len(schedule)
    assert len(kernel) == 0


children = st.lists(
    st.tuples(st.sampled_from([0.0, 0.0, 1.0, 3.0]), priorities, st.integers(100, 999)),
    max_size=4,
)


@given(st.lists(st.tuples(times, priorities, children), min_size=1, max_size=20))
def test_events_scheduled_while_running_join_the_same_order(
    schedule: list[tuple[float, int, list[tuple[float, int, int]]]],
) -> None:
    """Against a plain oracle: always deliver the least (time, priority, seq) pending."""
    recorder = Recorder()
    kernel = Kernel()
    pending: list[tuple[float, int, int, int, tuple[tuple[float, int, int], ...]]] = []
    for name, (time, priority, kids) in enumerate(schedule):
        kernel.schedule(time, priority, Note(recorder, name, tuple(kids)))
        pending.append((time, priority, len(pending), name, tuple(kids)))
    kernel.run()
    expected: list[tuple[float, int]] = []
    seq = len(pending)
    while pending:
        entry = min(pending)
        pending.remove(entry)
        now, _, _, name, grandchildren = entry
        expected.append((now, name))
        for delay, priority, child in grandchildren:
            pending.append((now + delay, priority, seq, child, ()))
            seq += 1
    assert [(now, name) for now, name, _ in recorder.seen] == expected


def test_ties_are_deterministic_fifo() -> None:
    recorder = Recorder()
    kernel = Kernel()
    for name in range(5):
        kernel.schedule(1.0, NORMAL, Note(recorder, name))
    kernel.schedule(1.0, URGENT, Note(recorder, 99))
    kernel.run()
    assert [name for _, name, _ in recorder.seen] == [99, 0, 1, 2, 3, 4]


def _kernel_with_notes(recorder: Recorder) -> Kernel:
    kernel = Kernel()
    for name, time in enumerate([1.0, 5.0, 5.0, 7.0, 10.0, 12.0]):
        kernel.schedule(time, NORMAL, Note(recorder, name))
    return kernel


def test_run_until_processes_earlier_events_and_stands_at_until() -> None:
    recorder = Recorder()
    kernel = _kernel_with_notes(recorder)
    kernel.run(until=10.0)
    assert [name for _, name, _ in recorder.seen] == [0, 1, 2, 3]
    assert kernel.now == 10.0
    assert kernel.peek() == 10.0  # the event at exactly `until` is still pending
    kernel.run(until=10.0)  # nothing earlier than 10 is left
    assert len(recorder.seen) == 4
    kernel.run()
    assert [name for _, name, _ in recorder.seen] == [0, 1, 2, 3, 4, 5]
    assert kernel.now == 12.0


@given(st.lists(st.sampled_from([0.0, 1.0, 5.0, 5.0, 6.5, 10.0, 20.0]), max_size=6))
def test_run_in_slices_equals_one_run(cuts: list[float]) -> None:
    whole, sliced = Recorder(), Recorder()
    _kernel_with_notes(whole).run(until=11.0)
    kernel = _kernel_with_notes(sliced)
    for cut in sorted(cuts):
        if cut <= 11.0:
            kernel.run(until=cut)
    kernel.run(until=11.0)
    assert sliced.seen == whole.seen


def test_empty_kernel() -> None:
    kernel = Kernel(start=3.0)
    assert kernel.peek() == math.inf
    assert kernel.step() is False
    kernel.run()
    assert kernel.now == 3.0
    kernel.run(until=8.0)
    assert kernel.now == 8.0


def test_refuses_the_past_nan_and_infinity() -> None:
    recorder = Recorder()
    kernel = Kernel()
    kernel.schedule(2.0, NORMAL, Note(recorder, 0))
    kernel.run()
    with pytest.raises(ValueError, match=r"the kernel is at 2\.0"):
        kernel.schedule(1.0, NORMAL, Note(recorder, 1))
    with pytest.raises(ValueError, match="cannot schedule"):
        kernel.schedule(math.nan, NORMAL, Note(recorder, 1))
    with pytest.raises(ValueError, match="infinity"):
        kernel.schedule(math.inf, NORMAL, Note(recorder, 1))
    with pytest.raises(ValueError, match=r"already at 2\.0"):
        kernel.run(until=1.0)
    with pytest.raises(ValueError, match="finite"):
        Kernel(start=math.nan)


def test_now_is_the_time_of_the_event_processed() -> None:
    recorder = Recorder()
    kernel = Kernel()
    kernel.schedule(4.25, NORMAL, Note(recorder, 0))
    assert kernel.now == 0.0
    kernel.step()
    assert kernel.now == 4.25


# -- local and shared events ------------------------------------------------------------------


@dataclass
class Watcher:
    """Records the kernel's ``next_shared()`` on every delivery, and may schedule children."""

    kernel: Kernel
    seen: list[tuple[float, int, float]] = field(default_factory=list)

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, Tagged)
        self.seen.append((now, event.name, self.kernel.next_shared()))
        return [
            ScheduledEvent(now + delay, priority, Tagged(self, name, True), local=True)
            for delay, priority, name in event.children
        ]


@dataclass(frozen=True, slots=True)
class Tagged:
    target: Watcher
    name: int
    local: bool
    children: tuple[tuple[float, int, int], ...] = ()


@given(st.lists(st.tuples(times, priorities, st.booleans(), children), min_size=1, max_size=20))
def test_local_events_keep_the_order_and_next_shared_is_the_first_shared_event(
    schedule: list[tuple[float, int, bool, list[tuple[float, int, int]]]],
) -> None:
    """Marking events local changes no delivery; ``next_shared`` is the earliest pending
    shared event (local events only schedule local ones)."""
    kernel = Kernel()
    watcher = Watcher(kernel)
    pending: list[tuple[float, int, int, int, bool, tuple[tuple[float, int, int], ...]]] = []
    for name, (time, priority, local, kids) in enumerate(schedule):
        kernel.schedule(time, priority, Tagged(watcher, name, local, tuple(kids)), local=local)
        pending.append((time, priority, len(pending), name, local, tuple(kids)))
    kernel.run()
    expected: list[tuple[float, int, float]] = []
    seq = len(pending)
    while pending:
        entry = min(pending)
        pending.remove(entry)
        now, _, _, name, _, grandchildren = entry
        shared = [e[0] for e in pending if not e[4]]
        expected.append((now, name, min(shared, default=math.inf)))
        for delay, priority, child in grandchildren:
            pending.append((now + delay, priority, seq, child, True, ()))
            seq += 1
    assert watcher.seen == expected


def test_run_until_bounds_next_shared() -> None:
    kernel = Kernel()
    watcher = Watcher(kernel)
    kernel.schedule(1.0, NORMAL, Tagged(watcher, 0, True), local=True)
    kernel.schedule(9.0, URGENT, Tagged(watcher, 1, False))
    kernel.run(until=4.0)
    assert watcher.seen == [(1.0, 0, 4.0)]
    assert kernel.next_shared() == 9.0  # outside a run: the shared event itself
    kernel.run()
    assert watcher.seen[-1] == (9.0, 1, math.inf)


def test_a_local_event_may_not_schedule_a_shared_one() -> None:
    kernel = Kernel()
    recorder = Recorder()
    kernel.schedule(1.0, NORMAL, Note(recorder, 0, ((1.0, NORMAL, 1),)), local=True)
    with pytest.raises(ValueError, match=r"a local event \(Note\) scheduled a shared one"):
        kernel.run()


def test_no_shared_event_before_a_promised_time() -> None:
    """A part may have run ahead to what ``next_shared`` said; the past of a part is closed."""
    kernel = Kernel()
    recorder = Recorder()
    kernel.schedule(5.0, URGENT, Note(recorder, 0))
    assert kernel.next_shared() == 5.0
    kernel.schedule(2.0, NORMAL, Note(recorder, 1), local=True)  # a part's own event: fine
    with pytest.raises(ValueError, match=r"parts may have run ahead to 5\.0"):
        kernel.schedule(3.0, URGENT, Note(recorder, 2))
    kernel.schedule(5.0, NORMAL, Note(recorder, 3))
    kernel.run()
    assert [name for _, name, _ in recorder.seen] == [1, 0, 3]
    kernel.schedule(kernel.now, URGENT, Note(recorder, 4))  # nothing left: no part is ahead
    assert len(kernel) == 1
