"""A streaming histogram with bounded relative error, for latencies counted in millions.

Inter-token gaps are one sample per generated token (an hour of the Azure trace has four
million). Storing them to sort later costs memory; ``LogHistogram`` keeps a count per
logarithmic bucket instead::

    bucket k holds values in (γ^(k-1), γ^k]          γ = (1 + α) / (1 - α)
    reported as 2γ^k / (γ + 1)                       within α of every value in the bucket

so every quantile it reports is within ``relative_accuracy`` (α) of a value that is really
at that rank, whatever the distribution (the idea of DDSketch, Masson et al., VLDB 2019).
Count, sum, min and max are exact. Buckets are integers in a dict, so two runs that add the
same values in the same order hold the same state.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from functools import reduce
from itertools import repeat
from math import ceil, log
from operator import add, mul, truediv

_MARGIN = 1e-6
"""How far inside a bucket (in units of ``log γ``) a value's ``log(v) / log γ`` must be for
``add_each`` to count the values between two such values in it without their logs."""


class LogHistogram:
    """Counts of positive values in logarithmic buckets; quantiles within ``relative_accuracy``."""

    __slots__ = ("_counts", "_log_gamma", "count", "max", "min", "relative_accuracy", "total")

    def __init__(self, relative_accuracy: float = 0.005) -> None:
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {relative_accuracy}")
        self.relative_accuracy = relative_accuracy
        gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = math.log(gamma)
        self._counts: dict[int, int] = {}
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float, count: int = 1) -> None:
        """Add ``count`` samples equal to ``value`` (``value > 0``)."""
        if not value > 0:
            raise ValueError(f"LogHistogram takes values > 0, got {value}")
        key = math.ceil(math.log(value) / self._log_gamma)
        counts = self._counts
        counts[key] = counts.get(key, 0) + count
        self.count += count
        self.total += value * count
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def add_each(self, values: Sequence[float], count: int = 1) -> None:
        """``add(value, count)`` for each of ``values`` in order, with the same result to the
        bit (the sum is accumulated in the same order), in one call.

        The per-value work runs in C (``functools.reduce`` and ``map`` over ``operator`` and
        ``math`` functions): the same float operations, in the same order, as the loop in
        :meth:`_add_each_slowly`, which handles a bad value (and what came before it) exactly
        as a run of :meth:`add` calls would. When the smallest and the largest value fall
        well inside one bucket (``_MARGIN`` from its edges, orders of magnitude more than
        ``math.log``'s error), every value between falls in it too: one count, no log each.
        """
        if not values:
            return
        total = reduce(add, map(mul, values, repeat(count)), self.total)
        low, high = min(values), max(values)
        if not (low > 0 and math.isfinite(total)):  # a value <= 0, NaN or inf: one by one
            self._add_each_slowly(values, count)
            return
        log_gamma, counts = self._log_gamma, self._counts
        lowest, highest = log(low) / log_gamma, log(high) / log_gamma
        key = ceil(highest)
        if highest <= key - _MARGIN and lowest >= key - 1 + _MARGIN:
            counts[key] = counts.get(key, 0) + count * len(values)
        else:
            get = counts.get
            for key, n in Counter(
                map(ceil, map(truediv, map(log, values), repeat(log_gamma)))
            ).items():
                counts[key] = get(key, 0) + n * count
        self.total = total
        self.min = min(self.min, low)
        self.max = max(self.max, high)
        self.count += count * len(values)

    def _add_each_slowly(self, values: Iterable[float], count: int) -> None:
        counts, log_gamma, log_, ceil_ = self._counts, self._log_gamma, math.log, math.ceil
        total, low, high, added = self.total, self.min, self.max, 0
        try:
            for value in values:
                if not value > 0:
                    raise ValueError(f"LogHistogram takes values > 0, got {value}")
                key = ceil_(log_(value) / log_gamma)
                counts[key] = counts.get(key, 0) + count
                total += value * count
                low = value if value < low else low  # min() and max() cost a call each
                high = value if value > high else high
                added += count
        finally:  # the values before a bad one stay added, as with add()
            self.count += added
            self.total, self.min, self.max = total, low, high

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The value at rank ``q × (count - 1)`` (0-based, lower), ``None`` when empty.

        ``quantile(0)`` and ``quantile(1)`` are the exact minimum and maximum.
        """
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if not self.count:
            return None
        if q == 0:
            return self.min
        if q == 1:
            return self.max
        rank = q * (self.count - 1)
        seen = 0
        gamma = math.exp(self._log_gamma)
        for key in sorted(self._counts):
            seen += self._counts[key]
            if seen > rank:
                value = 2 * math.exp(key * self._log_gamma) / (gamma + 1)
                return min(max(value, self.min), self.max)
        return self.max  # pragma: no cover - seen reaches count > rank

    def merge(self, other: LogHistogram) -> None:
        """Add every sample of ``other`` (same ``relative_accuracy``) to this histogram."""
        if other.relative_accuracy != self.relative_accuracy:
            raise ValueError("cannot merge histograms of different relative accuracy")
        counts = self._counts
        for key, count in other.buckets():
            counts[key] = counts.get(key, 0) + count
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def buckets(self) -> Iterator[tuple[int, int]]:
        """``(bucket, count)`` in bucket order: the whole state, for hashing and merging."""
        for key in sorted(self._counts):
            yield key, self._counts[key]
