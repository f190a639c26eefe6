"""L0: the demand forecaster on synthetic diurnal curves, and the forecast as a floor."""

from __future__ import annotations

import math

import pytest

from gpufleet.fleet import ReplicaState, ReplicaView
from gpufleet.policy import (
    AutoscaleConfig,
    AutoscalePolicy,
    DemandForecaster,
    ForecastConfig,
    PoolView,
    ScaleGuard,
)

from .factories import MODEL, rid, scraped

DAY = 86_400.0
HORIZON = 1_800.0


def diurnal(t: float) -> float:
    """Requests/s: trough of 20 at midnight, peak of 180 at noon."""
    return 100.0 - 80.0 * math.cos(2 * math.pi * (t % DAY) / DAY)


def fed(days: float, step: float = 60.0) -> DemandForecaster:
    forecaster = DemandForecaster(ForecastConfig())
    t = 0.0
    while t < days * DAY:
        forecaster.observe(t, diurnal(t))
        t += step
    return forecaster


def test_no_history_no_forecast() -> None:
    assert DemandForecaster(ForecastConfig()).forecast(0.0, HORIZON) is None


def test_trend_alone_extrapolates_a_ramp() -> None:
    forecaster = DemandForecaster(ForecastConfig())
    for i in range(30):
        forecaster.observe(i * 60.0, 10.0 + i)  # +1 per minute
    f = forecaster.forecast(29 * 60.0, 600.0)
    assert f is not None
    assert f.seasonal is None
    assert f.demand == pytest.approx(39.0 + 10.0, abs=1.5)


def test_season_forecasts_the_morning_ramp_before_it_starts() -> None:
    forecaster = fed(2.0 + 5.5 / 24)  # two days, then to 05:30 on day three
    now = 2 * DAY + 5.5 * 3600 - 60.0
    f = forecaster.forecast(now, HORIZON)
    assert f is not None
    assert f.period == DAY
    truth = diurnal(now + HORIZON)
    naive = diurnal(now)
    assert abs(f.demand - truth) < 0.25 * abs(naive - truth)
    assert f.demand > f.level


def test_level_ratio_scales_last_season_to_today() -> None:
    forecaster = DemandForecaster(ForecastConfig(seasonal_weight=1.0))
    t = 0.0
    while t < 1.5 * DAY:
        scale = 1.0 if t < DAY else 1.5  # today runs 50 % hotter than yesterday
        forecaster.observe(t, scale * diurnal(t))
        t += 60.0
    f = forecaster.forecast(t - 60.0, HORIZON)
    assert f is not None
    assert f.seasonal is not None
    assert f.seasonal == pytest.approx(1.5 * diurnal(t - 60.0 + HORIZON), rel=0.05)


def test_observing_backwards_is_a_bug() -> None:
    forecaster = DemandForecaster(ForecastConfig())
    forecaster.observe(600.0, 1.0)
    with pytest.raises(ValueError, match="before the last bucket"):
        forecaster.observe(0.0, 1.0)


def test_history_is_bounded() -> None:
    forecaster = DemandForecaster(ForecastConfig(seasonal_periods=(3600.0,), trend_window=600.0))
    for i in range(1000):
        forecaster.observe(i * 60.0, 1.0)
    assert len(forecaster.snapshot().buckets) <= (3600 + 1200) / 60 + 3


# -- the forecast as a floor under the reactive decision --------------------------------------

CAPACITY = 25.0  # requests/s one replica serves at saturation 1


def _run(forecast: bool) -> tuple[int, int]:
    """Two days of the curve with instant actuation; count day-two minutes in which the pool
    had fewer replicas than the load an horizon later needs, and forecast-bound decisions."""
    config = AutoscaleConfig(
        max_replicas=40,
        provisioning_horizon=HORIZON,
        scale_down_cooldown=600.0,
        forecast=ForecastConfig(enabled=forecast),
    )
    policy = AutoscalePolicy(config, 100)
    n, short, by_forecast, t = 2, 0, 0, 0.0
    while t < 2 * DAY:
        demand = diurnal(t)
        u = demand / (CAPACITY * n)
        running = min(100, round(u * 100))
        waiting = max(0, round(u * 100) - 100)
        replicas = tuple(
            ReplicaView(rid(i), MODEL, ReplicaState.READY, scraped(running, waiting, at=t))
            for i in range(n)
        )
        d = policy.decide(t, PoolView(MODEL, replicas, demand))
        n = d.desired
        if t >= DAY:
            need = math.ceil(diurnal(t + HORIZON) / CAPACITY / 0.65)
            short += n < need
            by_forecast += d.bound_by is ScaleGuard.FORECAST
        t += 60.0
    return short, by_forecast


def test_forecast_floor_provisions_ahead_of_the_ramp() -> None:
    reactive_short, none = _run(forecast=False)
    predictive_short, floored = _run(forecast=True)
    assert none == 0
    assert floored > 0
    assert reactive_short > 100
    assert predictive_short < reactive_short / 5


def test_the_bucket_in_progress_does_not_swing_the_trend() -> None:
    """Decisions every second: a new minute starts with one noisy one-second count."""
    forecaster = DemandForecaster(ForecastConfig())
    for s in range(15 * 60):
        forecaster.observe(float(s), 5.0)  # flat: 5 requests/s for 15 minutes
    forecaster.observe(900.0, 15.0)  # the first second of minute 15 saw 15 arrivals
    f = forecaster.forecast(900.0, 300.0)
    assert f is not None
    assert f.demand == pytest.approx(5.0)
