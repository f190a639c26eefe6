"""The retry budget shared by the gateway and the simulator."""

from __future__ import annotations

from gpufleet.policy import retry_allowed


def test_min_retry_concurrency_is_always_allowed() -> None:
    assert retry_allowed(2, 0, budget_percent=20.0, min_retry_concurrency=3)
    assert not retry_allowed(3, 0, budget_percent=20.0, min_retry_concurrency=3)


def test_budget_is_a_share_of_requests_in_flight() -> None:
    # 20 % of 100 in flight: 20 retries may run, the 21st may not start.
    assert retry_allowed(19, 100, budget_percent=20.0, min_retry_concurrency=3)
    assert not retry_allowed(20, 100, budget_percent=20.0, min_retry_concurrency=3)
