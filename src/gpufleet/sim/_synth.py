"""A day of diurnal load with spikes: real request sizes, arrivals drawn along a curve.

    curve = DiurnalCurve(peak_rps=6.0)                      # the documented default shape
    for request in synth_requests(curve, sizes, seed=0):    # TraceRequest, in arrival order
        ...
    many = zipf_models(synth_requests(...), names, s=1.1, seed=0)   # a Zipf model mix

Arrivals are a non-homogeneous Poisson process of rate ``curve.rate(t)``, drawn by thinning
(Lewis and Shedler, 1979): candidates at the curve's highest rate, each kept with
probability ``rate(t) / highest``. Each kept arrival takes the prompt and output lengths of
a row drawn uniformly (with replacement) from ``sizes`` (the Azure 2023 conversation
trace's). One ``random.Random(seed)`` draws everything in one fixed order, so a seed gives
one trace, to the byte. docs/traces.md documents the curve, the spikes and the defaults.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from gpufleet.sim._traces import TraceRequest

HOUR: Final = 3600.0


@dataclass(frozen=True, slots=True)
class Spike:
    """The rate is multiplied by ``factor`` from ``at_h`` (hours) for ``minutes``, with
    linear ramps of ``ramp_s`` seconds at both ends (inside the spike's span)."""

    at_h: float
    minutes: float
    factor: float
    ramp_s: float = 60.0

    def multiplier(self, t: float) -> float:
        start = self.at_h * HOUR
        end = start + self.minutes * 60.0
        if not start <= t < end:
            return 1.0
        ramp = min(self.ramp_s, (end - start) / 2)
        edge = min(t - start, end - t)
        share = 1.0 if ramp <= 0 or edge >= ramp else edge / ramp
        return 1.0 + (self.factor - 1.0) * share


DEFAULT_SPIKES: Final = (
    Spike(at_h=8.5, minutes=20.0, factor=1.5),  # the morning rush starts all at once
    Spike(at_h=13.0, minutes=5.0, factor=1.3),  # a short burst at the peak: the day's highest
    Spike(at_h=21.0, minutes=10.0, factor=1.6),  # an evening event, off-peak
)


@dataclass(frozen=True, slots=True)
class DiurnalCurve:
    """Requests/s over a day: a raised cosine from ``trough`` × to 1 × the base, lowest at
    ``trough_h`` and highest 12 hours later, times the spikes; scaled so that the highest
    rate of the whole curve (spikes included) is ``peak_rps``."""

    peak_rps: float
    hours: float = 24.0
    trough: float = 0.2
    """The base curve's lowest rate as a share of its highest."""
    trough_h: float = 4.0
    spikes: tuple[Spike, ...] = DEFAULT_SPIKES
    _scale: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.peak_rps) and self.peak_rps > 0):
            raise ValueError(f"peak_rps must be > 0, got {self.peak_rps}")
        if not self.hours > 0:
            raise ValueError(f"hours must be > 0, got {self.hours}")
        if not 0.0 < self.trough <= 1.0:
            raise ValueError(f"trough must be in (0, 1], got {self.trough}")
        for spike in self.spikes:
            if not (spike.factor > 0 and spike.minutes > 0):
                raise ValueError(f"a spike needs factor > 0 and minutes > 0: {spike}")
        highest = max(self._shape(float(t)) for t in range(0, math.ceil(self.hours * HOUR), 10))
        object.__setattr__(self, "_scale", self.peak_rps / highest)

    def base(self, t: float) -> float:
        """The diurnal shape without spikes, in (0, 1]."""
        phase = 2 * math.pi * ((t / HOUR - self.trough_h) % 24.0) / 24.0
        return self.trough + (1.0 - self.trough) * (1.0 - math.cos(phase)) / 2.0

    def _shape(self, t: float) -> float:
        value = self.base(t)
        for spike in self.spikes:
            value *= spike.multiplier(t)
        return value

    def rate(self, t: float) -> float:
        """Requests/s at ``t`` seconds from midnight."""
        return self._scale * self._shape(t)

    @property
    def highest(self) -> float:
        """An upper bound of :meth:`rate` (the thinning's candidate rate)."""
        return self.peak_rps * 1.01  # the peak was found on a 10 s grid


def synth_requests(
    curve: DiurnalCurve, sizes: Sequence[tuple[int, int]], *, seed: int
) -> Iterator[TraceRequest]:
    """Arrivals along ``curve`` for ``curve.hours``, sizes drawn from ``sizes``."""
    if not sizes:
        raise ValueError("no request sizes to draw from")
    rng = random.Random(f"gpufleet-trace-synth-{seed}")
    end, top = curve.hours * HOUR, curve.highest
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return
        if rng.random() * top < curve.rate(t):
            prompt, output = sizes[rng.randrange(len(sizes))]
            yield TraceRequest(round(t, 6), prompt, output)


def zipf_weights(n: int, s: float) -> list[float]:
    """The Zipf(``s``) shares of ranks 1..``n``: ``k**-s``, normalised to sum to 1."""
    if n < 1 or not s >= 0:
        raise ValueError(f"a Zipf mix needs n >= 1 and s >= 0, got n={n}, s={s}")
    raw = [k**-s for k in range(1, n + 1)]
    total = math.fsum(raw)
    return [w / total for w in raw]


def zipf_models(
    requests: Iterable[TraceRequest], models: Sequence[str], *, s: float = 1.1, seed: int
) -> Iterator[TraceRequest]:
    """``requests``, each naming one of ``models``: the ``k``-th (from 1, in the order
    given) with probability ∝ ``k**-s`` (:func:`zipf_weights`), drawn independently.

    A many-models fleet's mix (docs/residency.md): a few popular models and a long tail.
    ``random.Random(seed)`` draws one number per request, so a seed gives one mix."""
    if not models:
        raise ValueError("no models to draw from")
    cumulative = list(itertools.accumulate(zipf_weights(len(models), s)))
    rng = random.Random(f"gpufleet-zipf-models-{seed}")
    last = len(models) - 1
    for request in requests:
        k = min(bisect.bisect_right(cumulative, rng.random()), last)  # rounding at the top
        yield replace(request, model=models[k])
