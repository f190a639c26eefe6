"""Per-tenant quotas: requests per minute, tokens per minute, concurrent requests.

Pure and clock-injected (``.importlinter``: no asyncio, time or I/O; mypy strict), and the
gateway's own: the tenancy layer checks a request against its tenant's quota before the
request reaches the pool controller, so it is no pool-control policy and lives here rather
than in ``gpufleet.policy`` (the Redis adapter, ``_quotas_redis.py``, is the same arithmetic
shared across gateways). Both rates are exact sliding windows over the last 60 seconds (a log
of the window's events, at most ``rpm`` of them for requests), not token buckets: a bucket
that starts full lets a fresh tenant send two minutes' worth in its first minute, and the bar
is "within 5 % of the rate over any minute".

* A request is admitted if fewer than ``rpm`` requests started in the window, fewer than
  ``concurrency`` are running, and fewer than ``tpm`` tokens were charged in the window.
* Tokens (prompt + completion) are charged when a response completes, never up front: an
  admitted stream is never cut, so the window may end up over ``tpm`` by the requests that
  were running when it filled; the next requests then wait until it drains.

A denial says which limit and after how many seconds the same request would pass
(``Retry-After``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

WINDOW: Final = 60.0


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a request is refused now, and when to try again (whole seconds, ≥ 1)."""

    limit: str
    """``rpm``, ``tpm`` or ``concurrency``."""
    retry_after: int


class SlidingWindow:
    """Amounts recorded over the last ``window`` seconds."""

    __slots__ = ("_events", "_total", "window")

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def _expire(self, now: float) -> None:
        events, horizon = self._events, now - self.window
        while events and events[0][0] <= horizon:
            self._total -= events.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(now)
        return self._total

    def add(self, now: float, amount: int = 1) -> None:
        self._expire(now)
        if amount > 0:
            self._events.append((now, amount))
            self._total += amount

    def wait_below(self, now: float, limit: int) -> float:
        """Seconds until the window holds less than ``limit`` (0 if it does now)."""
        self._expire(now)
        excess = self._total - limit + 1
        if excess <= 0:
            return 0.0
        for at, amount in self._events:
            excess -= amount
            if excess <= 0:
                return at + self.window - now
        return self.window  # pragma: no cover - unreachable: the events sum to the total


class TenantQuota:
    """One tenant's counters against its limits."""

    __slots__ = ("_requests", "_tokens", "limits", "running")

    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self._requests = SlidingWindow()
        self._tokens = SlidingWindow()
        self.running = 0

    def check(self, now: float) -> Denial | None:
        """Whether one more request may start now (nothing is recorded)."""
        limits = self.limits
        if limits.concurrency is not None and self.running >= limits.concurrency:
            return Denial("concurrency", 1)
        if limits.rpm is not None:
            wait = self._requests.wait_below(now, limits.rpm)
            if wait > 0.0:
                return Denial("rpm", max(1, math.ceil(wait)))
        if limits.tpm is not None:
            wait = self._tokens.wait_below(now, limits.tpm)
            if wait > 0.0:
                return Denial("tpm", max(1, math.ceil(wait)))
        return None

    def start(self, now: float) -> None:
        self._requests.add(now)
        self.running += 1

    def finish(self, now: float, tokens: int) -> None:
        """A started request ended; ``tokens`` (prompt + completion) are charged now."""
        self.running = max(self.running - 1, 0)
        self._tokens.add(now, tokens)

    def requests_in_window(self, now: float) -> int:
        return self._requests.used(now)

    def tokens_in_window(self, now: float) -> int:
        return self._tokens.used(now)
