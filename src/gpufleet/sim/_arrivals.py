"""Synthetic arrival times: a Poisson process, or a gamma renewal process for bursty traffic."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """Requests arriving at ``rate`` per second on average, with gaps of variation ``cv``.

    ``cv = 1`` is a Poisson process (exponential gaps). Other values draw gamma gaps with
    shape ``1 / cv²`` and the same mean ``1 / rate``: ``cv > 1`` is burstier than Poisson,
    ``cv < 1`` more regular. All randomness comes from the ``random.Random`` passed in.
    """

    rate: float
    """Mean requests per second."""
    cv: float = 1.0
    """Coefficient of variation of the gaps between arrivals (standard deviation / mean)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"arrival rate must be a finite number > 0, got {self.rate}")
        if not (math.isfinite(self.cv) and self.cv > 0):
            raise ValueError(f"arrival cv must be a finite number > 0, got {self.cv}")

    def scaled(self, factor: float) -> ArrivalProcess:
        """The same process ``factor`` times as fast."""
        return ArrivalProcess(self.rate * factor, self.cv)

    def times(self, rng: random.Random) -> Iterator[float]:
        """Arrival times in seconds from 0, without end: the first after one gap."""
        now = 0.0
        if self.cv == 1.0:
            rate = self.rate
            expovariate = rng.expovariate
            while True:
                now += expovariate(rate)
                yield now
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (self.rate * shape)
        gammavariate = rng.gammavariate
        while True:
            now += gammavariate(shape, scale)
            yield now
