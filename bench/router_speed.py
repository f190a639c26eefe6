"""How much CPU one routing decision costs, per router, at 4, 16 and 64 replicas.

    .venv/bin/python bench/router_speed.py   # table + bench/results/router_speed.json

The gateway's budget is about 200 µs of CPU per proxied request, everything included, so a
decision should be a small share of it. Each router runs a steady stream of realistic
requests against one pool of READY replicas with fresh scrapes:

* prompts of 8–64 prefix blocks (512 characters each: 1k–8k tokens), behind one of 16
  shared system prompts, each the next turn of one of 500 conversations (so prefixes grow
  and repeat as in a chat service), with a session key per conversation;
* ``2 × replicas`` requests in flight: each decision is followed by ``on_request_start`` on
  the chosen replica and ``on_request_end`` of the oldest request;
* the prefix index is warmed by one pass before timing.

``rank`` is the decision alone; ``cycle`` adds the start and end bookkeeping (what the
gateway pays per request). Two baselines from the same run: the candidate pipeline alone
(``select_candidates``: the floor every router pays) and the gateway-side
``text_prefix_hashes`` of a 16 kB prompt. Best of ``--repeats`` runs; these machines are
noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import deque
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
    text_prefix_hashes,
)
from gpufleet.policy import ROUTER_POLICIES, RoutableFilter, make_router, select_candidates

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "router_speed.json"
MODEL = "m"
SIZES = (4, 16, 64)


@dataclass
class Result:
    policy: str
    replicas: int
    us_rank: float
    """Best run: µs per rank() call."""
    us_cycle: float
    """Best run: µs per rank() + on_request_start() + on_request_end()."""
    us_cycle_median: float
    decisions_per_s: float
    """1 / us_cycle."""


def make_view(replicas: int, rng: random.Random) -> FleetView:
    return FleetView.of(
        0.0,
        [
            ReplicaView(
                ReplicaId(f"replica-{i}"),
                MODEL,
                ReplicaState.READY,
                ReplicaLoad(
                    in_flight=rng.randrange(8),
                    running=rng.randrange(32),
                    waiting=rng.randrange(4),
                    kv_cache_usage=rng.random(),
                    observed_at=0.0,
                ),
            )
            for i in range(replicas)
        ],
    )


def make_requests(count: int, rng: random.Random) -> list[RouteRequest]:
    """Chat turns: a system prompt, then a conversation's growing history."""
    systems = [tuple(rng.getrandbits(62) for _ in range(rng.randint(4, 16))) for _ in range(16)]
    conversations = [list(rng.choice(systems)) for _ in range(500)]
    requests = []
    for n in range(count):
        c = rng.randrange(len(conversations))
        history = conversations[c]
        if len(history) >= 64:  # the conversation ends; a new one starts in its place
            history[:] = rng.choice(systems)
        history.extend(rng.getrandbits(62) for _ in range(rng.randint(2, 6)))
        blocks = tuple(history)
        requests.append(RouteRequest(f"q{n}", MODEL, blocks, len(blocks) * 128, f"conv-{c}"))
    return requests


def run_once(
    policy: str, view: FleetView, requests: list[RouteRequest], seed: int
) -> tuple[float, float]:
    """(seconds in rank, seconds in the whole cycle) over ``requests``, after a warm pass."""
    router = make_router(policy, random.Random(seed))
    clock = time.perf_counter
    live: deque[tuple[RouteRequest, ReplicaId]] = deque()
    keep = 2 * len(view)
    rank, start, end = router.rank, router.on_request_start, router.on_request_end
    for warm in (True, False):
        in_rank = 0.0
        t_begin = clock()
        for request in requests:
            t0 = clock()
            ranking = rank(0.0, request, view)
            in_rank += clock() - t0
            replica = ranking.tiers[0][0]
            start(0.0, request, replica)
            live.append((request, replica))
            if len(live) > keep:
                done, where = live.popleft()
                end(0.0, done, where, Outcome.SUCCESS)
        total = clock() - t_begin
        if not warm:
            return in_rank, total
    raise AssertionError("unreachable")


def baseline_candidates(view: FleetView, requests: list[RouteRequest]) -> float:
    filters = (RoutableFilter(0.5),)
    clock = time.perf_counter
    t0 = clock()
    for request in requests:
        select_candidates(request, view, filters)
    return (clock() - t0) / len(requests) * 1e6


def baseline_hashing(rng: random.Random, repeats: int = 2000) -> float:
    words = ["system", "user", "assistant", "the", "model", "router", "cache", "prefix"]
    text = " ".join(rng.choice(words) for _ in range(2600))[:16_384]
    clock = time.perf_counter
    t0 = clock()
    for _ in range(repeats):
        text_prefix_hashes(text)
    return (clock() - t0) / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="timed decisions per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per router and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    requests = make_requests(args.requests, rng)
    results: list[Result] = []
    floors: dict[int, float] = {}
    for size in SIZES:
        view = make_view(size, rng)
        floors[size] = min(baseline_candidates(view, requests) for _ in range(args.repeats))
        for policy in ROUTER_POLICIES:
            runs = [run_once(policy, view, requests, args.seed) for _ in range(args.repeats)]
            n = len(requests)
            best_rank = min(r for r, _ in runs) / n * 1e6
            cycles = [c / n * 1e6 for _, c in runs]
            results.append(
                Result(
                    policy,
                    size,
                    best_rank,
                    min(cycles),
                    statistics.median(cycles),
                    1e6 / min(cycles),
                )
            )
    hashing = min(baseline_hashing(rng) for _ in range(args.repeats))

    table = Table(title="router speed: µs of CPU per routing decision (best of runs)")
    table.add_column("policy")
    for size in SIZES:
        table.add_column(f"rank @{size}", justify="right")
        table.add_column(f"cycle @{size}", justify="right")
    for policy in ROUTER_POLICIES:
        row = [policy]
        for size in SIZES:
            r = next(x for x in results if x.policy == policy and x.replicas == size)
            row += [f"{r.us_rank:.1f}", f"{r.us_cycle:.1f}"]
        table.add_row(*row)
    table.add_row("(candidates only)", *[v for s in SIZES for v in (f"{floors[s]:.1f}", "")])
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
    console.print(
        "rank: rank() alone. cycle: rank() + on_request_start() + on_request_end(), what the "
        "gateway pays per request. candidates only: the filter pipeline every router runs. "
        f"Gateway-side text_prefix_hashes of a 16 kB prompt: {hashing:.1f} µs."
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(["python bench/router_speed.py", *(argv or sys.argv[1:])]),
        "requests": args.requests,
        "repeats": args.repeats,
        "seed": args.seed,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "baseline_candidates_us": floors,
        "baseline_text_prefix_hashes_16kB_us": hashing,
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
