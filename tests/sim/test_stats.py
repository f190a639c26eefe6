"""The streaming histogram: quantiles within the relative accuracy; exact count, mean, bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.sim import LogHistogram

values = st.floats(min_value=1e-6, max_value=1e4, allow_nan=False)


@given(st.lists(values, min_size=1, max_size=300), st.floats(min_value=0.0, max_value=1.0))
def test_quantiles_are_within_the_relative_accuracy(sample: list[float], q: float) -> None:
    histogram = LogHistogram(relative_accuracy=0.01)
    for value in sample:
        histogram.add(value)
    exact = sorted(sample)[math.floor(q * (len(sample) - 1))]
    got = histogram.quantile(q)
    assert got is not None
    assert abs(got - exact) <= 0.01 * exact * (1 + 1e-9)


def test_exact_moments_and_weights() -> None:
    histogram = LogHistogram()
    histogram.add(0.010, count=3)
    histogram.add(0.030)
    assert histogram.count == 4
    assert histogram.mean == pytest.approx(0.015)
    assert (histogram.min, histogram.max) == (0.010, 0.030)
    assert histogram.quantile(0.0) == 0.010
    assert histogram.quantile(1.0) == 0.030
    assert histogram.quantile(0.5) == pytest.approx(0.010, rel=0.005)


def test_merge_equals_adding_everything() -> None:
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    for i in range(1, 50):
        (a if i % 2 else b).add(i / 100)
        both.add(i / 100)
    a.merge(b)
    assert list(a.buckets()) == list(both.buckets())
    assert (a.count, a.min, a.max) == (both.count, both.min, both.max)
    assert a.total == pytest.approx(both.total)
    with pytest.raises(ValueError, match="relative accuracy"):
        a.merge(LogHistogram(0.1))


def test_empty_and_bad_input() -> None:
    histogram = LogHistogram()
    assert histogram.quantile(0.5) is None
    assert histogram.mean is None
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="values > 0"):
            histogram.add(bad)
    with pytest.raises(ValueError, match="quantile"):
        histogram.quantile(1.5)
    with pytest.raises(ValueError, match="relative_accuracy"):
        LogHistogram(0.0)


def _state(histogram: LogHistogram) -> tuple[object, ...]:
    buckets = list(histogram.buckets())
    return buckets, histogram.count, histogram.total.hex(), histogram.min, histogram.max


@given(st.lists(values, max_size=50), st.lists(values, max_size=50), st.integers(1, 300))
def test_add_each_is_add_one_by_one_to_the_bit(
    before: list[float], sample: list[float], count: int
) -> None:
    one_by_one, at_once = LogHistogram(), LogHistogram()
    for value in before:
        one_by_one.add(value)
        at_once.add(value)
    for value in sample:
        one_by_one.add(value, count)
    at_once.add_each(sample, count)
    assert _state(at_once) == _state(one_by_one)


def test_add_each_refuses_a_value_that_is_not_positive_and_keeps_the_ones_before() -> None:
    histogram = LogHistogram()
    with pytest.raises(ValueError, match="values > 0"):
        histogram.add_each([0.5, 0.0, 2.0])
    assert (histogram.count, histogram.total, histogram.min, histogram.max) == (1, 0.5, 0.5, 0.5)


@given(
    st.floats(1e-4, 10.0),
    st.lists(st.floats(-1e-6, 1e-6), min_size=1, max_size=60),
    st.integers(1, 40),
    st.booleans(),
)
def test_add_each_of_close_values_is_add_one_by_one_to_the_bit(
    center: float, offsets: list[float], count: int, on_an_edge: bool
) -> None:
    """A run's inter-token gaps: close values, often in one bucket, sometimes across an edge
    (``on_an_edge`` moves the center onto one)."""
    one_by_one, at_once = LogHistogram(), LogHistogram()
    if on_an_edge:
        gamma = math.exp(one_by_one._log_gamma)
        center = gamma ** round(math.log(center) / one_by_one._log_gamma)
    sample = [center * (1.0 + offset) for offset in offsets]
    for value in sample:
        one_by_one.add(value, count)
    at_once.add_each(sample, count)
    assert _state(at_once) == _state(one_by_one)
    assert list(at_once._counts.items()) == list(one_by_one._counts.items())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0])
def test_add_each_handles_a_bad_value_as_add_does(bad: float) -> None:
    one_by_one, at_once = LogHistogram(), LogHistogram()
    sample = [0.25, 0.5, bad, 2.0]

    def one_by_one_adds() -> None:
        for value in sample:
            one_by_one.add(value, 3)

    with pytest.raises((ValueError, OverflowError)) as slow:
        one_by_one_adds()
    with pytest.raises((ValueError, OverflowError)) as fast:
        at_once.add_each(sample, 3)
    assert type(fast.value) is type(slow.value)
    assert _state(at_once) == _state(one_by_one)
