"""Synthetic arrivals: the right mean rate and burstiness, from the run's seeded rng."""

from __future__ import annotations

import math
import random
import statistics
from itertools import islice

import pytest

from gpufleet.sim import ArrivalProcess

N = 20_000


def gaps(process: ArrivalProcess, seed: int) -> list[float]:
    times = list(islice(process.times(random.Random(seed)), N))
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


@pytest.mark.parametrize("rate", [0.5, 5.53, 400.0])
def test_poisson_has_the_mean_rate(rate: float) -> None:
    sample = gaps(ArrivalProcess(rate), seed=11)
    # exponential gaps: the standard error of the mean gap is (1 / rate) / sqrt(N)
    assert abs(statistics.fmean(sample) - 1 / rate) < 4 * (1 / rate) / math.sqrt(N)
    assert statistics.stdev(sample) / statistics.fmean(sample) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_the_burstiness(cv: float) -> None:
    sample = gaps(ArrivalProcess(10.0, cv=cv), seed=5)
    assert abs(statistics.fmean(sample) - 0.1) < 5 * cv * 0.1 / math.sqrt(N)
    assert statistics.stdev(sample) / statistics.fmean(sample) == pytest.approx(cv, rel=0.1)


def test_same_seed_same_times() -> None:
    process = ArrivalProcess(3.0, cv=2.0)
    assert gaps(process, 1) == gaps(process, 1)
    assert gaps(process, 1) != gaps(process, 2)


def test_scaled() -> None:
    assert ArrivalProcess(2.0, cv=3.0).scaled(1.5) == ArrivalProcess(3.0, cv=3.0)


@pytest.mark.parametrize(("rate", "cv"), [(0.0, 1.0), (-1.0, 1.0), (math.inf, 1.0), (1.0, 0.0)])
def test_refuses_bad_parameters(rate: float, cv: float) -> None:
    with pytest.raises(ValueError, match="arrival"):
        ArrivalProcess(rate, cv)
