"""Demand forecasting for the autoscaler: seasonal-naive with a level ratio, blended with a trend.

History is kept as one mean per ``bucket`` seconds, for the longest season plus a trend
window (a week of one-minute buckets is ~10k floats). To forecast demand at ``t + h``::

    history  ······[ t-P-W … t-P ]····( t+h-P )··························[ t-W … t ]
                     ref level          last season's value                level, slope
    seasonal = value(t+h-P) × clamp(level / ref, 1/r, r)      (the longest season P with data)
    trend    = level + slope × (t + h - centre of [t-W, t])
    forecast = w × seasonal + (1 - w) × trend                 (trend alone without a season)

so a ramp that happened yesterday at this hour is expected again, scaled to today's level,
and a ramp with no precedent is extrapolated from the last ``trend_window`` (of finished
buckets: the one in progress holds too few samples to fit on). Everything is
floats and loops: no numpy, no fitting state beyond the buckets.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpufleet.policy._autoscale_config import ForecastConfig


@dataclass(frozen=True, slots=True)
class Forecast:
    """Demand expected at ``at`` (same unit as observed: requests/s or tokens/s)."""

    at: float
    demand: float
    level: float
    """Mean demand over the last trend window."""
    trend: float
    """The trend's own prediction."""
    seasonal: float | None
    """The seasonal prediction, or ``None`` when no season has enough history."""
    period: float | None
    """The season used (seconds)."""


@dataclass(frozen=True, slots=True)
class ForecastSnapshot:
    buckets: tuple[tuple[int, float, int], ...]
    """``(bucket index, demand sum, samples)`` oldest first."""


class DemandForecaster:
    """Remembers demand samples and forecasts demand ahead; pure, ``now`` given by the caller."""

    def __init__(self, config: ForecastConfig) -> None:
        self._config = config
        self._buckets: dict[int, tuple[float, int]] = {}
        self._order: deque[int] = deque()
        longest = max(config.seasonal_periods, default=0.0)
        self._keep = math.ceil((longest + 2 * config.trend_window) / config.bucket) + 2

    def observe(self, now: float, demand: float) -> None:
        """Record ``demand`` measured at ``now`` (times must not go back)."""
        if demand < 0.0 or not math.isfinite(demand):
            raise ValueError(f"demand must be finite and >= 0, got {demand}")
        index = math.floor(now / self._config.bucket)
        if self._order and index < self._order[-1]:
            raise ValueError(f"demand observed at {now}, before the last bucket")
        total, count = self._buckets.get(index, (0.0, 0))
        if count == 0:
            self._order.append(index)
        self._buckets[index] = (total + demand, count + 1)
        while self._order[0] < index - self._keep:
            del self._buckets[self._order.popleft()]

    def forecast(self, now: float, horizon: float) -> Forecast | None:
        """Demand expected at ``now + horizon``; ``None`` with no history in the trend window."""
        window, bucket = self._config.trend_window, self._config.bucket
        recent = self._points(now - window, now)
        if not recent:
            return None
        # The bucket in progress is left out while a finished one exists: a decision every
        # second starts each minute with one or two one-second counts, whose noise, at the
        # end of the fit, swings the slope (and the forecast a horizon ahead) every minute.
        finished = [p for p in recent if p[0] + bucket / 2 <= now]
        recent = finished or recent
        at = now + horizon
        level = sum(v for _, v in recent) / len(recent)
        trend = max(0.0, level + _slope(recent) * (at - (now - window / 2)))
        for period in sorted(self._config.seasonal_periods, reverse=True):
            seasonal = self._seasonal(now, at, period, level)
            if seasonal is not None:
                w = self._config.seasonal_weight
                return Forecast(at, w * seasonal + (1 - w) * trend, level, trend, seasonal, period)
        return Forecast(at, trend, level, trend, None, None)

    def snapshot(self) -> ForecastSnapshot:
        return ForecastSnapshot(tuple((i, *self._buckets[i]) for i in self._order))

    def _seasonal(self, now: float, at: float, period: float, level: float) -> float | None:
        window, bucket = self._config.trend_window, self._config.bucket
        then = self._points(at - period - bucket, at - period + bucket)
        ref = self._points(now - period - window, now - period)
        if not then or not ref:
            return None
        ref_level = sum(v for _, v in ref) / len(ref)
        value = sum(v for _, v in then) / len(then)
        if ref_level <= 0.0:
            return value if level <= 0.0 else None
        r = self._config.max_level_ratio
        return value * min(r, max(1.0 / r, level / ref_level))

    def _points(self, start: float, end: float) -> list[tuple[float, float]]:
        """``(bucket centre, mean)`` of the buckets overlapping ``[start, end]``."""
        bucket = self._config.bucket
        lo, hi = math.floor(start / bucket), math.floor(end / bucket)
        points = []
        for i in range(lo, hi + 1):
            entry = self._buckets.get(i)
            if entry is not None:
                points.append(((i + 0.5) * bucket, entry[0] / entry[1]))
        return points


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``points``; 0 with fewer than two distinct times."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0.0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx
