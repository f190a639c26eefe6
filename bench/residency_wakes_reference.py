"""How many wakes bench/residency_many_models.py's trace needs: offline cache references.

    .venv/bin/python bench/residency_wakes_reference.py     # a few seconds

The same trace (20 models, Zipf 1.1, 2 req/s for 10 min, seed 0) replayed through 8 slots
holding one model each, every request for a model not resident a miss (a wake), with no
wake time (so no two requests share a wake, as held ones do in the simulation):

* **OPT** (Belady): evict the resident asked for again furthest in the future, the
  clairvoyant lower bound;
* **LRU**; **decayed LFU** (the policy's demand meter alone: evict the lowest arrival rate
  decayed with a half-life; 60 s is ``DEMAND_HALF_LIFE``);
* **static**: the 7 most requested models (known in hindsight) pinned, the rest taking
  turns on the eighth slot.
"""

from __future__ import annotations

import collections
from collections import OrderedDict

from gpufleet.sim import SAMPLE_TRACE, DiurnalCurve, load_trace, synth_requests, zipf_models
from residency_many_models import GPUS, MODELS


def trace() -> tuple[list[str], list[float]]:
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(SAMPLE_TRACE)]
    curve = DiurnalCurve(peak_rps=2.0, hours=10.0 / 60, trough=1.0, spikes=())
    requests = list(zipf_models(synth_requests(curve, sizes, seed=0), MODELS, s=1.1, seed=0))
    return [str(r.model) for r in requests], [r.arrival_s for r in requests]


def lru(seq: list[str], k: int) -> int:
    cache: OrderedDict[str, None] = OrderedDict()
    misses = 0
    for m in seq:
        if m in cache:
            cache.move_to_end(m)
            continue
        misses += 1
        if len(cache) >= k:
            cache.popitem(last=False)
        cache[m] = None
    return misses


def opt(seq: list[str], k: int) -> int:
    following = [0] * len(seq)
    seen: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        following[i] = seen.get(seq[i], len(seq))
        seen[seq[i]] = i
    cache: dict[str, int] = {}
    misses = 0
    for i, m in enumerate(seq):
        if m not in cache:
            misses += 1
            if len(cache) >= k:
                del cache[max(cache, key=cache.__getitem__)]
        cache[m] = following[i]
    return misses


def decayed_lfu(seq: list[str], times: list[float], k: int, half_life: float) -> int:
    count: dict[str, float] = {}
    at: dict[str, float] = {}

    def rate(m: str, t: float) -> float:
        return count.get(m, 0.0) * 0.5 ** ((t - at.get(m, t)) / half_life)

    cache: set[str] = set()
    misses = 0
    for m, t in zip(seq, times, strict=True):
        count[m], at[m] = rate(m, t) + 1.0, t
        if m not in cache:
            misses += 1
            if len(cache) >= k:
                cache.remove(min(cache, key=lambda x: rate(x, t)))
            cache.add(m)
    return misses


def static(seq: list[str], k: int) -> int:
    pinned = {m for m, _ in collections.Counter(seq).most_common(k - 1)}
    misses, current = k - 1, None
    for m in seq:
        if m not in pinned and m != current:
            misses, current = misses + 1, m
    return misses


def main() -> None:
    seq, times = trace()
    counts = collections.Counter(seq)
    tail = sum(counts[m] for m in MODELS[GPUS:])
    print(f"{len(seq)} requests; ranks {GPUS + 1}-{len(MODELS)} ask {tail} of them")
    print(f"OPT {opt(seq, GPUS)}, LRU {lru(seq, GPUS)}, static top-{GPUS - 1} {static(seq, GPUS)}")
    for half_life in (30.0, 60.0, 300.0, 1e9):
        print(f"decayed LFU, half-life {half_life:g} s: {decayed_lfu(seq, times, GPUS, half_life)}")


if __name__ == "__main__":
    main()
