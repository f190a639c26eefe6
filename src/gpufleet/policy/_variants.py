"""Which variant of a served model a request goes to: weighted, sticky, deterministic.

A served name (what clients send as ``model``) maps to one or more variants (pools), each
with a weight. A request's *key* (its session key, else its request id) picks one by
weighted rendezvous hashing::

    score(variant) = -ln(u) / weight      u = BLAKE2b(key, variant) in (0, 1)
    chosen         = the variant with the lowest score

Each score is an exponential draw of rate ``weight``, so a variant is chosen with
probability ``weight / Σ weights``; the same key always gives the same variant (a
conversation does not flip versions); and changing one variant's weight moves keys only to
it (raised) or away from it (lowered), never between two others: a rollout that raises the
new version's weight from 5 to 20 to 100 moves each session at most once, old → new.

The hash is BLAKE2b, not Python's ``hash`` (salted per process): the gateway, a replay of
its recording and the simulator choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from hashlib import blake2b
from typing import Final

_SCALE: Final = 2.0**64


def variant_point(key: str, variant: str) -> float:
    """The key's uniform draw for ``variant``, in (0, 1): stable across processes."""
    digest = blake2b(f"{key}\x00{variant}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SCALE


def choose_variant(key: str, variants: Sequence[tuple[str, float]]) -> str | None:
    """The variant ``key`` goes to among ``(name, weight)`` pairs; weights ≤ 0 are never
    chosen; ``None`` when none has a positive weight."""
    if len(variants) == 1:
        name, weight = variants[0]
        return name if weight > 0 else None
    best: str | None = None
    best_score = math.inf
    for name, weight in variants:
        if weight <= 0:
            continue
        score = -math.log(variant_point(key, name)) / weight
        if score < best_score:
            best, best_score = name, score
    return best
