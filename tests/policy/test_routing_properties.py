"""L1: routing invariants under any sequence of replica states, requests and completions.

Invariants (every router, after every step):

* a ranking names each replica at most once, and only replicas of the request's model;
* outside panic it names only routable (READY) replicas, and all of them; in panic, exactly
  the pool's in-service replicas, and only when fewer than the threshold are routable;
* each router's in-flight count equals the requests started and not yet ended;
* least_request ranks a least-loaded replica first; the prefix index stays within its bound;
* round robin is fair, and the same seed gives the same rankings.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpufleet.fleet import (
    IN_SERVICE,
    ROUTABLE,
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaState,
    ReplicaView,
    RouteRequest,
)
from gpufleet.policy import ROUTER_POLICIES, PrefixAwareRouter, PrefixIndex, Ranking, make_router

from .factories import make_request, make_view, rid

STATES = st.sampled_from(list(ReplicaState))
PANIC = 0.5
OTHER = "other"


def _chain(blocks: list[int]) -> tuple[int, ...]:
    """Chained prefix hashes of a list of block contents (what a gateway would compute)."""
    out, h = [], 0
    for b in blocks:
        h = hash((h, b))
        out.append(h)
    return tuple(out)


PROMPTS = st.lists(st.integers(0, 3), max_size=6).map(_chain)
SESSIONS = st.none() | st.sampled_from(["a", "b", "c", "d", "e"])


class RouterMachine(RuleBasedStateMachine):
    """One router (any policy) over a pool whose replicas change state while requests come
    and go."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[ReplicaState] = []
        self.in_flight: list[tuple[RouteRequest, ReplicaId]] = []
        self.count = 0
        self.now = 0.0

    @initialize(
        policy=st.sampled_from(ROUTER_POLICIES),
        size=st.integers(1, 7),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(self, policy: str, size: int, seed: int) -> None:
        self.policy = policy
        self.rng = random.Random(seed)
        settings_ = {"policy": self.policy, "panic_threshold": PANIC}
        if self.policy in {"prefix_aware", "prefix_precise"}:  # no feed: precise's fallback
            settings_ |= {"index_blocks": 5, "balance_abs": 1.0}
        self.router = make_router(settings_, self.rng)
        self.states = [ReplicaState.READY] * size

    def view(self) -> FleetView:
        others = [ReplicaView(ReplicaId(f"o{i}"), OTHER, ReplicaState.READY) for i in range(2)]
        return make_view(self.states, self.now, extra=others)

    @rule(i=st.integers(0, 6), state=STATES)
    def set_state(self, i: int, state: ReplicaState) -> None:
        self.states[i % len(self.states)] = state

    @rule(prompt=PROMPTS, session=SESSIONS, start=st.booleans(), dt=st.floats(0, 1))
    def route(self, prompt: tuple[int, ...], session: str | None, start: bool, dt: float) -> None:
        self.now += dt
        self.count += 1
        request = make_request(self.count, prompt, tokens=10, session=session)
        view = self.view()
        ranking = self.router.rank(self.now, request, view)
        self.check_ranking(ranking, view)
        if start and ranking.tiers:
            replica = ranking.tiers[0][0]
            self.router.on_request_start(self.now, request, replica)
            self.in_flight.append((request, replica))

    def check_ranking(self, ranking: Ranking, view: FleetView) -> None:
        named = ranking.replicas()
        assert len(named) == len(set(named)), "a replica ranked twice"
        assert all(tier for tier in ranking.tiers), "an empty tier"
        pool = view.pool("m")
        states = {r.id: r.state for r in pool}
        assert set(named) <= set(states), "a replica of another pool"
        ready = {r for r, s in states.items() if s in ROUTABLE}
        in_service = {r for r, s in states.items() if s in IN_SERVICE}
        if ranking.panic:
            assert set(named) == in_service
            assert len(ready) < PANIC * len(in_service)
        else:
            assert set(named) == ready, "outside panic: exactly the routable replicas"
        if self.policy == "least_request" and named:
            load = Counter(r for _, r in self.in_flight)
            assert load[named[0]] == min(load[r] for r in named)

    @precondition(lambda self: self.in_flight)
    @rule(pick=st.integers(0, 100), outcome=st.sampled_from(list(Outcome)))
    def finish(self, pick: int, outcome: Outcome) -> None:
        request, replica = self.in_flight.pop(pick % len(self.in_flight))
        self.router.on_request_end(self.now, request, replica, outcome)

    @invariant()
    def in_flight_matches(self) -> None:
        if not hasattr(self, "router"):
            return
        expected = Counter(r for _, r in self.in_flight)
        assert dict(self.router.snapshot().load.in_flight) == expected  # type: ignore[attr-defined]

    @invariant()
    def prefix_index_within_bound(self) -> None:
        router = getattr(self, "router", None)
        if isinstance(router, PrefixAwareRouter):
            router.check()
            assert all(size <= 5 for size in router.snapshot().index_sizes.values())


TestRouter = RouterMachine.TestCase
TestRouter.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)


# -- single properties ------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 9), rounds=st.integers(1, 4), skip=st.integers(0, 20))
def test_round_robin_is_fair_over_n_calls(n: int, rounds: int, skip: int) -> None:
    router, view = make_router("round_robin", random.Random(0)), make_view(n)
    for i in range(skip):  # wherever the cursor stands
        router.rank(0.0, make_request(i), view)
    firsts = Counter(router.rank(0.0, make_request(i), view).first() for i in range(n * rounds))
    assert firsts == {rid(i): rounds for i in range(n)}


@settings(max_examples=80, deadline=None)
@given(loads=st.lists(st.integers(0, 5), min_size=1, max_size=10), seed=st.integers(0, 99))
def test_least_request_ranks_by_in_flight(loads: list[int], seed: int) -> None:
    router = make_router("least_request", random.Random(seed))
    for i, load in enumerate(loads):
        for _ in range(load):
            router.on_request_start(0.0, make_request(), rid(i))
    (tier,) = router.rank(0.0, make_request(), make_view(len(loads))).tiers
    ranked = [loads[int(r[1:])] for r in tier]
    assert ranked == sorted(loads)


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 6),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2), max_size=5), st.booleans()),
        max_size=30,
    ),
)
def test_prefix_index_matches_a_plain_lru_model(
    capacity: int, ops: list[tuple[int, list[int], bool]]
) -> None:
    """Against a list-based model: same matches, and never more than capacity per replica."""
    index = PrefixIndex(capacity)
    model: dict[ReplicaId, OrderedDict[int, None]] = {}
    for replica_no, blocks, forget in ops:
        replica, hashes = rid(replica_no), _chain(blocks)
        if forget:
            index.forget(replica)
            model.pop(replica, None)
            continue
        lru = model.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            lru.pop(h, None)
            lru[h] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
        index.insert(replica, hashes)
        index.check()
        assert all(index.size(r) <= capacity for r in index.replicas())
        assert len(index) <= capacity * len(index.replicas())
        expected = {}
        for r, held in model.items():
            depth = 0
            while depth < len(hashes) and hashes[depth] in held:
                depth += 1
            if depth:
                expected[r] = depth
        assert index.match(hashes) == expected


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(ROUTER_POLICIES))
def test_one_seed_gives_one_run(seed: int, policy: str) -> None:
    def run() -> list[tuple[tuple[ReplicaId, ...], ...]]:
        script = random.Random(seed)
        router = make_router(policy, random.Random(seed))
        view, out, live = make_view(5), [], []
        for n in range(60):
            request = make_request(
                n, _chain([script.randrange(3) for _ in range(3)]), session=str(script.randrange(4))
            )
            ranking = router.rank(float(n), request, view)
            out.append(ranking.tiers)
            router.on_request_start(float(n), request, ranking.tiers[0][0])
            live.append((request, ranking.tiers[0][0]))
            if script.random() < 0.5:
                done = live.pop(script.randrange(len(live)))
                router.on_request_end(float(n), done[0], done[1], Outcome.SUCCESS)
        return out

    assert run() == run()
