"""The batch gate's TTFT guard (policy/_spare_ttft.py): the baseline without batch lines,
the verdict on requests beside them, the cut, and the growth it governs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.policy import SpareCapacity, SpareConfig, SpareView
from gpufleet.policy._spare_ttft import GuardSettings, TtftGuard, p99
from tests.policy.test_spare import view as spare_view

GUARD = GuardSettings(margin=0.1, bound=None, window=60.0, samples=5, refresh=600.0, hold=10.0)


def view(**kw: object) -> SpareView:
    """test_spare's pool (two replicas of 10 slots), 50 lines waiting."""
    return spare_view(**{"batch_waiting": 50, **kw})


def test_p99_is_the_nearest_rank() -> None:
    assert p99([0.3, 0.1, 0.2]) == 0.3
    assert p99([float(i) for i in range(1, 101)]) == 99.0


def test_the_baseline_is_the_p99_of_requests_with_no_batch_line_beside_them() -> None:
    guard = TtftGuard(GUARD)
    for t in range(4):
        guard.observe(float(t), 0.1, beside=False)
    assert guard.baseline is None  # four samples: not enough
    guard.observe(4.0, 0.2, beside=False)
    assert guard.baseline == 0.2
    assert guard.measured_at == 4.0


def test_beside_samples_over_the_margin_are_over_and_within_it_are_not() -> None:
    guard = TtftGuard(GUARD)
    for t in range(5):
        guard.observe(float(t), 0.1, beside=False)  # baseline 0.1
    for t in range(5):
        guard.observe(10.0 + t, 0.105, beside=True)  # 5 % over: within the margin
    assert not guard.over(20.0)
    for t in range(5):
        guard.observe(30.0 + t, 0.12, beside=True)  # 20 % over
    assert guard.over(40.0)
    guard.cut(40.0)
    assert not guard.over(41.5)  # judged afresh: no beside sample since the cut


def test_a_bound_needs_no_baseline() -> None:
    guard = TtftGuard(replace(GUARD, margin=None, bound=0.5))
    for t in range(5):
        guard.observe(float(t), 0.6, beside=True)
    assert guard.holding(5.0) is None  # nothing to measure first
    assert guard.over(5.0)


def test_old_beside_samples_leave_the_window() -> None:
    guard = TtftGuard(replace(GUARD, margin=None, bound=0.5))
    for t in range(5):
        guard.observe(float(t), 0.6, beside=True)
    assert not guard.over(100.0)  # all older than the 60 s window


def test_new_lines_wait_while_the_baseline_is_measured_then_go() -> None:
    gate = SpareCapacity(SpareConfig(ttft_margin=0.1, ttft_samples=5, ttft_hold=10.0))
    held = gate.decide(0.0, view())
    assert (held.room, held.pressure, held.next_at) == (0, "baseline", 10.0)
    guard = gate.guard
    assert guard is not None
    for t in range(5):
        guard.observe(1.0 + t, 0.1, beside=False)
    assert gate.decide(6.0, view()).room > 0  # measured: lines go
    # 600 s on, it is measured again; with too few requests the hold gives up after 10 s
    assert gate.decide(606.0, view()).pressure == "baseline"
    assert gate.decide(616.0, view()).room > 0
    assert guard.baseline == 0.1  # the old one stays


def test_the_guard_governs_growth_one_step_per_verdict_and_cuts_over_the_margin() -> None:
    config = SpareConfig(ttft_margin=0.1, ttft_samples=5, interval=0.2, increase=1.0)
    gate = SpareCapacity(config)
    guard = gate.guard
    assert guard is not None
    for t in range(5):
        guard.observe(t * 0.1, 0.1, beside=False)
    now = 1.0
    for _ in range(10):  # from its first look: one step (2 replicas × 1), then no more
        gate.decide(now, view(batch_in_flight=2))
        now += 0.2
    assert gate.limit == 2.0
    for i in range(5):  # a verdict within the margin: one more step (doubled: no cut yet)
        guard.observe(now + i * 0.01, 0.1, beside=True)
    now += 1.0
    for _ in range(10):
        gate.decide(now, view(batch_in_flight=2))
        now += 0.2
    assert gate.limit == 4.0
    for i in range(5):  # a verdict over the margin: cut, nothing starts
        guard.observe(now + i * 0.01, 0.5, beside=True)
    now += 1.0
    cut = gate.decide(now, view(batch_in_flight=4, in_flight=4))
    assert (cut.pressure, cut.room, gate.limit) == ("ttft", 0, 2.0)
    assert gate.decide(now + 0.5, view(batch_in_flight=4, in_flight=4)).next_at == now + 1.5


def test_with_no_verdict_for_a_window_the_guard_lets_the_limit_climb() -> None:
    gate = SpareCapacity(SpareConfig(ttft_margin=0.1, ttft_samples=5, ttft_window=30.0))
    guard = gate.guard
    assert guard is not None
    for t in range(5):
        guard.observe(t * 0.1, 0.1, beside=False)
    gate.decide(1.0, view())
    gate.decide(2.0, view())
    assert gate.limit == 2.0  # one step, then a verdict is awaited
    gate.decide(40.0, view())  # no interactive request came beside batch lines: let go
    assert gate.limit == 4.0
    gate.decide(40.2, view())
    assert gate.limit == 8.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.001, 2.0), st.booleans()),
        max_size=200,
    )
)
def test_the_guard_never_raises_and_over_means_enough_slow_samples(
    samples: list[tuple[float, float, bool]],
) -> None:
    """Any samples in time order: no error, and a verdict over the bound only with
    ``samples`` beside samples in the window whose P99 is above it."""
    guard = TtftGuard(replace(GUARD, margin=None, bound=0.5))
    now = 0.0
    for dt, ttft, beside in samples:
        now += dt
        guard.observe(now, ttft, beside)
        over = guard.over(now + 1.0)  # each look a full GUARD_LOOK after the last
        inside = [t for at, t in guard._beside]
        if over:
            assert len(inside) >= 5
            assert p99(inside) > 0.5
        now += 1.0


@pytest.mark.parametrize(
    ("field", "value"), [("ttft_margin", 0.0), ("ttft_p99", -1.0), ("ttft_samples", 2)]
)
def test_bad_guard_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SpareConfig.model_validate({field: value})
