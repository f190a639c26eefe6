"""How much prefix cache each router keeps, and how evenly it loads the replicas.

    .venv/bin/python bench/router_quality.py   # table + bench/results/router_quality.json

Each request stream is replayed in virtual time against ``--replicas`` replicas, each with an
LRU cache of ``--capacities`` prefix blocks, and routed by every router in the same run. The
reference is one pooled LRU cache as large as all the replicas' caches together, fed the
same stream: the best any router could do without copying blocks between replicas.

* ``mooncake``: the Mooncake FAST'25 conversation trace (12,031 requests over 59 minutes;
  ``hash_ids`` are 512-token prefix blocks), read from ``--trace``; skipped when absent.
  ``--speeds`` compresses its clock (4 = four times the arrival rate).
* ``synthetic``: seeded multi-turn conversations behind eight Zipf-popular system prompts,
  each with a session key (so ``session`` routing has something to hold on to).

The cache model (the bench's own; the real replica model lives in ``gpufleet.engine.model``):
a request hits the leading blocks its replica holds, then all its blocks become the most
recently used, root last (vLLM frees a sequence's blocks tail first). A request occupies its
replica for ``uncached tokens / 10,000 tok/s + output tokens × 30 ms`` (no queueing), and
every 0.25 s the routers see a scrape: running = in flight, KV usage = in-flight tokens over
the cache size. The bar (issue 4): ``prefix_aware`` keeps at least 80 % of the pooled hit
rate while no replica gets more than 1.5 × the mean prompt tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpufleet.fleet import (
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    RouteRequest,
)
from gpufleet.policy import ROUTER_POLICIES, make_router

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "router_quality.json"
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512
PREFILL_TOKENS_PER_S = 10_000.0
TPOT_S = 0.03
SCRAPE_S = 0.25
MODEL = "m"
POLICIES = ("round_robin", "least_request", "kv_aware", "session", "prefix_aware")
assert set(POLICIES) == set(ROUTER_POLICIES)


@dataclass(frozen=True, slots=True)
class Req:
    at: float
    blocks: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    session: str | None


@dataclass
class Result:
    workload: str
    capacity_blocks: int
    speed: float
    policy: str
    hit_rate: float
    """Prefix blocks served from cache / all prompt blocks."""
    of_pooled: float
    """hit_rate / the pooled cache's hit rate."""
    max_over_mean_tokens: float
    """Prompt tokens of the busiest replica / the mean over replicas."""
    mean_matched_blocks: float
    """Mean prefix blocks the router's index believed the chosen replica held."""


# -- request streams --------------------------------------------------------------------------


def mooncake(path: Path) -> list[Req]:
    requests = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            requests.append(
                Req(
                    row["timestamp"] / 1000.0,
                    tuple(row["hash_ids"]),
                    row["input_length"],
                    row["output_length"],
                    None,
                )
            )
    return requests


def synthetic(seed: int, conversations: int = 3000) -> list[Req]:
    """Conversations arriving at 4/s, 1–12 turns each, 5–40 s apart, behind shared prompts."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    systems = [tuple(next(next_id) for _ in range(rng.randint(2, 8))) for _ in range(8)]
    weights = [1 / (k + 1) ** 1.2 for k in range(len(systems))]
    requests = []
    start = 0.0
    for c in range(conversations):
        start += rng.expovariate(4.0)
        history = rng.choices(systems, weights)[0]
        at = start
        for _ in range(min(12, 1 + int(rng.expovariate(1 / 3)))):
            history += tuple(next(next_id) for _ in range(rng.randint(1, 8)))  # the user turn
            output = rng.randint(50, 600)
            requests.append(Req(at, history, len(history) * BLOCK_TOKENS, output, f"conv-{c}"))
            history += tuple(next(next_id) for _ in range(math.ceil(output / BLOCK_TOKENS)))
            at += rng.uniform(5.0, 40.0)
    requests.sort(key=lambda r: r.at)
    return requests


# -- the cache model --------------------------------------------------------------------------


class BlockLRU:
    """An LRU of prefix blocks: hits are the leading blocks held, then all become recent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def access(self, blocks: Sequence[int]) -> int:
        held = self.blocks
        hits = 0
        while hits < len(blocks) and blocks[hits] in held:
            hits += 1
        for b in reversed(blocks):
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        while len(held) > self.capacity:
            held.popitem(last=False)
        return hits


def pooled_hit_rate(requests: Sequence[Req], capacity: int) -> float:
    cache = BlockLRU(capacity)
    hits = sum(cache.access(r.blocks) for r in requests)
    return hits / sum(len(r.blocks) for r in requests)


# -- the replay -------------------------------------------------------------------------------


def replay(
    requests: Sequence[Req],
    policy: str,
    *,
    replicas: int,
    capacity: int,
    speed: float,
    seed: int,
) -> tuple[float, float, float]:
    """(hit rate, max / mean prompt tokens, mean matched blocks) of one router on one stream."""
    ids = [ReplicaId(f"r{i}") for i in range(replicas)]
    settings: dict[str, object] = {"policy": policy}
    if policy == "prefix_aware":
        settings["index_blocks"] = capacity
    router = make_router(settings, random.Random(seed))
    caches = {r: BlockLRU(capacity) for r in ids}
    tokens = dict.fromkeys(ids, 0)
    in_flight = dict.fromkeys(ids, 0)
    held_tokens = dict.fromkeys(ids, 0)
    ends: list[tuple[float, int, RouteRequest, ReplicaId, int]] = []
    hits = total = matched = 0
    view = scrape(ids, in_flight, held_tokens, capacity, 0.0)
    next_scrape = SCRAPE_S
    for n, req in enumerate(requests):
        now = req.at / speed
        while ends and ends[0][0] <= now:
            end, _, done, replica, held = heapq.heappop(ends)
            router.on_request_end(end, done, replica, Outcome.SUCCESS)
            in_flight[replica] -= 1
            held_tokens[replica] -= held
        if now >= next_scrape:
            view = scrape(ids, in_flight, held_tokens, capacity, now)
            next_scrape = now + SCRAPE_S
        request = RouteRequest(str(n), MODEL, req.blocks, req.prompt_tokens, req.session)
        ranking = router.rank(now, request, view)
        replica = ranking.tiers[0][0]
        router.on_request_start(now, request, replica)
        matched += ranking.matched(replica)
        hit = caches[replica].access(req.blocks)
        hits += hit
        total += len(req.blocks)
        tokens[replica] += req.prompt_tokens
        in_flight[replica] += 1
        held = req.prompt_tokens + req.output_tokens
        held_tokens[replica] += held
        uncached = max(0, req.prompt_tokens - hit * BLOCK_TOKENS)
        duration = uncached / PREFILL_TOKENS_PER_S + req.output_tokens * TPOT_S
        heapq.heappush(ends, (now + duration, n, request, replica, held))
    mean = sum(tokens.values()) / replicas
    return hits / total, max(tokens.values()) / mean, matched / len(requests)


def scrape(
    ids: Sequence[ReplicaId],
    in_flight: dict[ReplicaId, int],
    held_tokens: dict[ReplicaId, int],
    capacity: int,
    now: float,
) -> FleetView:
    cache_tokens = capacity * BLOCK_TOKENS
    return FleetView.of(
        now,
        [
            ReplicaView(
                r,
                MODEL,
                ReplicaState.READY,
                ReplicaLoad(
                    in_flight=in_flight[r],
                    running=in_flight[r],
                    kv_cache_usage=min(1.0, held_tokens[r] / cache_tokens),
                    observed_at=now,
                ),
            )
            for r in ids
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--capacities",
        default="500,1000,4000,16000",
        help="prefix blocks per replica cache, comma-separated (1000 × 512 tokens ≈ the KV "
        "cache of an 8B model on one H100)",
    )
    parser.add_argument("--speeds", default="1,4", help="Mooncake clock compression factors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]
    speeds = [float(s) for s in args.speeds.split(",")]

    streams: list[tuple[str, list[Req], list[float]]] = [("synthetic", synthetic(args.seed), [1.0])]
    if args.trace.exists():
        streams.insert(0, ("mooncake", mooncake(args.trace), speeds))
    else:
        print(f"no trace at {args.trace}: Mooncake skipped", file=sys.stderr)

    results: list[Result] = []
    pooled: dict[str, dict[int, float]] = {}
    for workload, requests, workload_speeds in streams:
        pooled[workload] = {}
        for capacity in capacities:
            reference = pooled_hit_rate(requests, capacity * args.replicas)
            pooled[workload][capacity] = reference
            for speed in workload_speeds:
                for policy in POLICIES:
                    hit, spread, match = replay(
                        requests,
                        policy,
                        replicas=args.replicas,
                        capacity=capacity,
                        speed=speed,
                        seed=args.seed,
                    )
                    results.append(
                        Result(
                            workload, capacity, speed, policy, hit, hit / reference, spread, match
                        )
                    )

    table = Table(title=f"router quality: {args.replicas} replicas, LRU prefix caches")
    for column in (
        "workload",
        "blocks",
        "speed",
        "policy",
        "hit rate",
        "of pooled",
        "max/mean",
        "pooled",
    ):
        table.add_column(column, justify="left" if column in ("workload", "policy") else "right")
    for r in results:
        table.add_row(
            r.workload,
            f"{r.capacity_blocks:,}",
            f"{r.speed:g}×",
            r.policy,
            f"{r.hit_rate:.1%}",
            f"{r.of_pooled:.0%}",
            f"{r.max_over_mean_tokens:.2f}",
            f"{pooled[r.workload][r.capacity_blocks]:.1%}",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
    bar = [r for r in results if r.policy == "prefix_aware"]
    passed = all(r.of_pooled >= 0.8 and r.max_over_mean_tokens <= 1.5 for r in bar)
    console.print(
        "hit rate: prefix blocks served from the replica's cache. of pooled: against one LRU "
        "as large as all replicas' caches, same stream. max/mean: prompt tokens of the busiest "
        f"replica over the mean. prefix_aware bar (≥ 80 % of pooled, ≤ 1.5×): "
        f"{'met' if passed else 'NOT met'} in every row."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(["python bench/router_quality.py", *(argv or sys.argv[1:])]),
        "replicas": args.replicas,
        "block_tokens": BLOCK_TOKENS,
        "service_model": {
            "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
            "tpot_s": TPOT_S,
            "scrape_s": SCRAPE_S,
        },
        "seed": args.seed,
        "pooled_hit_rate": pooled,
        "prefix_aware_bar_met": passed,
        "python": platform.python_version(),
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
