"""The retry budget (as Envoy has it): one rule for the gateway and the simulator alike."""

from __future__ import annotations


def retry_allowed(
    active_retries: int, in_flight: int, *, budget_percent: float, min_retry_concurrency: int
) -> bool:
    """Whether one more retry may start now.

    Retries in flight may be at most ``budget_percent`` of the requests in flight, so a failing
    fleet does not double its own load; ``min_retry_concurrency`` retries are always allowed.
    """
    allowed = max(min_retry_concurrency, budget_percent / 100.0 * in_flight)
    return active_retries < allowed
