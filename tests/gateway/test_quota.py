"""Quotas: exact sliding windows, tokens charged at completion, Retry-After that holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.gateway._tenant_quota import QuotaLimits, SlidingWindow, TenantQuota


def test_rpm_admits_exactly_the_limit_per_window() -> None:
    quota = TenantQuota(QuotaLimits(rpm=3))
    for t in (0.0, 1.0, 2.0):
        assert quota.check(t) is None
        quota.start(t)
        quota.finish(t, 0)
    denial = quota.check(10.0)
    assert denial is not None
    assert (denial.limit, denial.retry_after) == ("rpm", 50)
    assert quota.check(60.0) is None  # the first left the window


def test_tpm_is_charged_at_completion_and_never_up_front() -> None:
    quota = TenantQuota(QuotaLimits(tpm=100))
    quota.start(0.0)
    assert quota.check(0.5) is None  # a running request costs nothing yet
    quota.finish(1.0, 250)  # overshoot: the stream was not cut
    denial = quota.check(2.0)
    assert denial is not None
    assert (denial.limit, denial.retry_after) == ("tpm", 59)
    assert quota.check(61.0) is None


def test_concurrency() -> None:
    quota = TenantQuota(QuotaLimits(concurrency=2))
    quota.start(0.0)
    quota.start(0.0)
    denial = quota.check(0.0)
    assert denial is not None
    assert denial.limit == "concurrency"
    quota.finish(0.1, 5)
    assert quota.check(0.1) is None


@given(st.lists(st.floats(0.0, 0.5), min_size=1, max_size=300), st.integers(1, 20))
def test_no_sixty_second_window_holds_more_than_rpm(gaps: list[float], rpm: int) -> None:
    """Whatever the arrivals, the starts in any window of 60 s are at most ``rpm``, and a
    request retried after its Retry-After passes."""
    quota = TenantQuota(QuotaLimits(rpm=rpm))
    starts: list[float] = []
    now = 0.0
    for gap in gaps:
        now += gap * 60
        denial = quota.check(now)
        if denial is None:
            quota.start(now)
            starts.append(now)
        else:  # at now + Retry-After, fewer than rpm starts are left in the window
            later = now + denial.retry_after
            assert sum(1 for u in starts if u > later - 60.0 + 1e-6) < rpm
    for i, t in enumerate(starts):
        assert sum(1 for u in starts[i:] if u < t + 60.0) <= rpm


def test_window_wait_below() -> None:
    window = SlidingWindow(10.0)
    window.add(0.0, 5)
    window.add(4.0, 5)
    assert window.wait_below(5.0, 6) == 5.0  # the first event leaves at 10
    assert window.wait_below(5.0, 11) == 0.0
