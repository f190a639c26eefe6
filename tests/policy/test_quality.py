"""L1 (offline quality): prefix-aware routing keeps nearly all of a pooled cache's hits.

A seeded synthetic stream of multi-turn conversations behind shared system prompts goes to
four replicas, each with an LRU cache of prefix blocks. ``prefix_aware`` must reach 80 % of
the hit rate of one LRU as large as the four together, with no replica given more than
1.5 × the mean prompt tokens, and beat ``round_robin``. (bench/router_quality.py runs the
same check on the Mooncake trace, at several cache sizes.)
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest

from gpufleet.fleet import Outcome, RouteRequest
from gpufleet.policy import make_router

from .factories import MODEL, make_view

REPLICAS, CAPACITY, BLOCK_TOKENS = 4, 150, 512


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.held = capacity, OrderedDict[int, None]()

    def access(self, blocks: Sequence[int]) -> int:
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.held:
            hits += 1
        for b in reversed(blocks):
            self.held.pop(b, None)
            self.held[b] = None
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)
        return hits


def _stream(seed: int = 0) -> list[tuple[float, tuple[int, ...]]]:
    rng, ids = random.Random(seed), iter(range(10**9))
    systems = [tuple(next(ids) for _ in range(rng.randint(2, 6))) for _ in range(4)]
    out, start = [], 0.0
    for _ in range(250):
        start += rng.expovariate(2.0)
        history, at = rng.choice(systems), start
        for _ in range(rng.randint(1, 8)):
            history += tuple(next(ids) for _ in range(rng.randint(1, 4)))
            out.append((at, history))
            history += (next(ids),)  # the answer
            at += rng.uniform(2.0, 20.0)
    return sorted(out)


def _replay(policy: str, stream: list[tuple[float, tuple[int, ...]]]) -> tuple[float, float]:
    router = make_router(
        {"policy": policy, "index_blocks": CAPACITY} if policy == "prefix_aware" else policy,
        random.Random(1),
    )
    view = make_view(REPLICAS)
    caches = [_LRU(CAPACITY) for _ in range(REPLICAS)]
    tokens = [0] * REPLICAS
    ends: list[tuple[float, int, RouteRequest, str]] = []
    hits = total = 0
    for n, (now, blocks) in enumerate(stream):
        while ends and ends[0][0] <= now:
            end, _, done, replica = heapq.heappop(ends)
            router.on_request_end(end, done, replica, Outcome.SUCCESS)  # type: ignore[arg-type]
        request = RouteRequest(str(n), MODEL, blocks, len(blocks) * BLOCK_TOKENS)
        replica = router.rank(now, request, view).tiers[0][0]
        router.on_request_start(now, request, replica)
        index = int(replica[1:])
        hits += caches[index].access(blocks)
        total += len(blocks)
        tokens[index] += request.prompt_tokens
        heapq.heappush(ends, (now + 3.0, n, request, replica))
    return hits / total, max(tokens) / (sum(tokens) / REPLICAS)


@pytest.fixture(scope="module")
def stream() -> list[tuple[float, tuple[int, ...]]]:
    return _stream()


def test_prefix_aware_keeps_the_pooled_hit_rate_and_the_balance(
    stream: list[tuple[float, tuple[int, ...]]],
) -> None:
    pooled = _LRU(CAPACITY * REPLICAS)
    pooled_rate = sum(pooled.access(b) for _, b in stream) / sum(len(b) for _, b in stream)
    prefix_rate, prefix_spread = _replay("prefix_aware", stream)
    rr_rate, _ = _replay("round_robin", stream)
    assert 0.2 < pooled_rate < 0.9  # the caches are under pressure, and prefixes do repeat
    assert prefix_rate >= 0.8 * pooled_rate
    assert prefix_spread <= 1.5
    assert prefix_rate > rr_rate * 1.2
