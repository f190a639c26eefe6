"""The spare-capacity gate's TTFT guard: batch lines may not push interactive TTFT P99 up
by more than a configured margin (``gateway.batch.spare.ttft_margin``) or past a bound
(``ttft_p99``).

Pure and clock-injected. The pool controller tells it each interactive request's time to
first token when the request ends, and whether batch lines were running when it arrived::

    alone     samples of requests that arrived with no batch line in flight: the P99 of
              the last ``ttft_window`` seconds of them is the baseline, what the pool does
              without batch work
    baseline  measured whenever ``ttft_samples`` alone samples are there; when the last
              is older than ``ttft_refresh`` (or there is none yet), the gate holds new
              lines back until it is measured again, for ``ttft_hold`` seconds at most
              (the lines in flight end, the next requests arrive alone; with too few
              requests to measure, the old baseline stays)
    beside    samples of requests that arrived beside batch lines, since the gate's limit
              was last cut, over the last ``ttft_window`` seconds
    over      ``ttft_samples`` beside samples or more, and their P99 above
              baseline × (1 + ttft_margin), or above ``ttft_p99``

Each verdict is on fresh evidence: the beside samples start afresh after one. The guard
governs the limit's growth from the gate's first look: one step, then one step per verdict
within the margin (the gate's own climb, a step every ``interval``, would be far above a
harmful level before the first verdict could say so). When it is over, the gate cuts its
limit as it does under pressure. So the limit saws around the largest share of batch work that keeps
interactive TTFT within the margin. With no verdict for ``ttft_window`` seconds (too few
interactive requests beside batch lines to judge), the guard stops governing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

GUARD_LOOK: Final = 1.0
"""Seconds between two verdicts (the gate may ask on every event; a P99 sorts)."""


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class GuardSettings:
    margin: float | None
    bound: float | None
    window: float
    samples: int
    refresh: float
    hold: float


class TtftGuard:
    """One pool's interactive TTFT samples, alone and beside batch lines, and its verdict."""

    __slots__ = (
        "_alone",
        "_beside",
        "_checked_at",
        "_governed_at",
        "_grants",
        "_hold_from",
        "_over",
        "_started",
        "baseline",
        "measured_at",
        "settings",
    )

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self._alone: deque[tuple[float, float]] = deque()
        self._beside: deque[tuple[float, float]] = deque()
        self.baseline: float | None = None
        """The P99 TTFT of requests with no batch line beside them (``None``: not measured
        yet; until it is, only ``ttft_p99`` can hold lines back)."""
        self.measured_at: float | None = None
        """When the baseline was last measured (or a hold for it gave up)."""
        self._hold_from: float | None = None
        self._checked_at: float | None = None
        self._over = False
        self._governed_at: float | None = None
        """When it last cut or judged while governing the growth (``None``: not governing)."""
        self._grants = 0
        self._started = False
        """Additive steps its verdicts within the margin allowed, not yet taken."""

    def observe(self, now: float, ttft: float, beside: bool) -> None:
        """An interactive request answered ``ttft`` seconds after it arrived; ``beside``:
        batch lines were in flight in its pool when it arrived."""
        window = self.settings.window
        samples = self._beside if beside else self._alone
        samples.append((now, ttft))
        while samples[0][0] < now - window:
            samples.popleft()
        if not beside and len(samples) >= self.settings.samples:
            self._measure(now)

    def _measure(self, now: float) -> None:
        self.baseline = p99([t for _, t in self._alone])
        self.measured_at, self._hold_from = now, None

    def holding(self, now: float) -> float | None:
        """While the baseline is (re)measured, until when new batch lines wait; ``None``:
        they need not."""
        settings, measured = self.settings, self.measured_at
        if settings.margin is None:
            return None  # a bound alone needs no baseline
        if measured is not None and now - measured < settings.refresh:
            return None
        if self._hold_from is None:
            self._hold_from = now
        until = self._hold_from + settings.hold
        if now >= until:  # too few requests to measure it by: keep the old one a while
            self.measured_at, self._hold_from = now, None
            return None
        return until

    def over(self, now: float) -> bool:
        """Whether the samples beside batch lines break the margin or the bound."""
        checked = self._checked_at
        if checked is not None and now - checked < GUARD_LOOK:
            return self._over
        self._checked_at = now
        settings, beside = self.settings, self._beside
        while beside and beside[0][0] < now - settings.window:
            beside.popleft()
        over = False
        if len(beside) >= settings.samples:
            tail = p99([t for _, t in beside])
            if settings.bound is not None and tail > settings.bound:
                over = True
            baseline = self.baseline
            if settings.margin is not None and baseline is not None:
                over = over or tail > baseline * (1.0 + settings.margin)
            if not over:  # a verdict within the margin: the next is on fresh samples
                beside.clear()
                if self._governed_at is not None:
                    self._governed_at = now
                    self._grants += 1
        self._over = over
        return over

    def cut(self, now: float) -> None:
        """The gate cut its limit on this verdict: judge the cut limit on its own samples,
        and govern the growth from here."""
        self._beside.clear()
        self._over = False
        self._checked_at = None
        self._governed_at, self._grants = now, 0

    def may_grow(self, now: float) -> bool:
        """Whether the gate's limit may take an additive step now (one per verdict within
        the margin while the guard governs it)."""
        governed = self._governed_at
        if governed is None and not self._started:  # governs from its first look: one
            self._started = True  # step, then one per verdict (its lines make the samples)
            governed = self._governed_at = now
            self._grants = 1
        if governed is None:
            return True
        if now - governed > self.settings.window:  # no verdict for a window: let go
            self._governed_at = None
            return True
        if self._grants > 0:
            self._grants -= 1
            return True
        return False

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "baseline": self.baseline,
            "measured_at": self.measured_at,
            "alone": len(self._alone),
            "beside": len(self._beside),
        }
