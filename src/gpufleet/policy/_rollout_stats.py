"""The two one-sided tests a rollout's analysis runs, in plain Python (no SciPy).

Both ask "is the new variant *worse* than the old one?" and answer with a p-value, the
probability of a difference at least this large if the two were alike.

* :func:`mann_whitney_greater`: latencies. Ranks, not means: a few long outliers (a
  prefill behind a long prompt) move it little, and it assumes no distribution; the normal
  approximation of U is fine from the few tens of samples a step needs (``min_samples``).
* :func:`two_proportion_greater`: error rates (5xx and timeouts per request), exact
  (Fisher's test): errors are rare, where the normal approximation is far too eager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _upper_tail(z: float) -> float:
    """P(Z ≥ z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney_greater(new: Sequence[float], old: Sequence[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test that ``new`` tends to be larger than
    ``old`` (ties get average ranks; tie-corrected variance; continuity correction).
    1.0 when either side is empty or every value is equal."""
    n1, n2 = len(new), len(old)
    if n1 == 0 or n2 == 0:
        return 1.0
    values = sorted([(v, 1) for v in new] + [(v, 0) for v in old])
    n = n1 + n2
    rank_new = 0.0
    ties = 0.0
    i = 0
    while i < n:  # a run of equal values shares the average of its ranks (1-based)
        j = i
        while j + 1 < n and values[j + 1][0] == values[i][0]:
            j += 1
        run = j - i + 1
        average = (i + j) / 2 + 1
        rank_new += average * sum(values[k][1] for k in range(i, j + 1))
        ties += run**3 - run
        i = j + 1
    u = rank_new - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if variance <= 0:
        return 1.0
    return _upper_tail((u - mean - 0.5) / math.sqrt(variance))


def two_proportion_greater(new_hits: int, new_total: int, old_hits: int, old_total: int) -> float:
    """One-sided p-value that the new rate (``new_hits / new_total``) is above the old one:
    Fisher's exact test (the hypergeometric tail: of all the hits, at least ``new_hits``
    landing on the new side by chance). Exact, because errors are rare and a step's new side
    small (4 of 40 against 2 %: the normal approximation says p = 0.0006, the truth is 0.008).
    1.0 when a side is empty or there is no hit."""
    if new_total == 0 or old_total == 0:
        return 1.0
    hits, total = new_hits + old_hits, new_total + old_total
    if hits == 0:
        return 1.0

    def log_choose(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    denominator = log_choose(total, new_total)
    tail = 0.0
    for k in range(new_hits, min(hits, new_total) + 1):
        tail += math.exp(
            log_choose(hits, k) + log_choose(total - hits, new_total - k) - denominator
        )
    return min(tail, 1.0)


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile by nearest rank (``None``: no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]
