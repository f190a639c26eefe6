"""The admission queue: strict classes, virtual-token-counter fairness, shedding, deadlines."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.fleet import ReplicaLoad, ReplicaState, ReplicaView
from gpufleet.policy import (
    AdmissionConfig,
    FairQueue,
    PoolAdmission,
    PoolGauge,
    Ticket,
    pool_saturated,
)

_ids = iter(range(10**9))


def ticket(tenant: str, priority: int = 0, weight: float = 1.0, **kw: float) -> Ticket:
    return Ticket(f"{tenant}-{next(_ids)}", tenant, priority, weight, **kw)  # type: ignore[arg-type]


def test_interactive_always_before_batch() -> None:
    queue = FairQueue()
    queue.offer(0, ticket("b", priority=1))
    queue.offer(0, ticket("a", priority=0))
    first = queue.pop(0)
    assert first is not None
    assert first.tenant == "a"


def test_the_tenant_with_the_least_service_goes_first() -> None:
    queue = FairQueue(AdmissionConfig(output_weight=2.0))
    for _ in range(3):
        queue.offer(0, ticket("heavy", prompt_estimate=100))
    queue.offer(0, ticket("light", prompt_estimate=100))
    order = []
    while (t := queue.pop(0)) is not None:
        order.append(t.tenant)
        queue.charge(t, uncached_prompt=100, output=50 if t.tenant == "heavy" else 0)
    assert order == ["heavy", "light", "heavy", "heavy"]


def test_cached_prompts_cost_less() -> None:
    queue = FairQueue()
    a, b = ticket("a", prompt_estimate=1000), ticket("b", prompt_estimate=1000)
    queue.start(a)
    queue.start(b)
    queue.charge(a, uncached_prompt=100, output=10)  # 900 of its prompt hit the cache
    queue.charge(b, uncached_prompt=1000, output=10)
    assert queue.counters["a"] < queue.counters["b"]


def test_weights_divide_the_charge() -> None:
    queue = FairQueue()
    a, b = ticket("a", weight=2.0), ticket("b", weight=1.0)
    queue.start(a)
    queue.start(b)
    queue.charge(a, 100, 0)
    queue.charge(b, 100, 0)
    assert queue.counters["a"] * 2 == queue.counters["b"]


def test_an_idle_tenant_cannot_bank_credit() -> None:
    queue = FairQueue()
    busy = ticket("busy")
    queue.start(busy)
    queue.charge(busy, 10_000, 0)
    queue.offer(0, ticket("busy"))
    queue.offer(0, ticket("newcomer"))  # lifted to the busy tenant's counter
    assert queue.counters["newcomer"] == queue.counters["busy"]


def test_a_full_queue_sheds_the_lowest_class_first() -> None:
    queue = FairQueue(AdmissionConfig(max_queue=2))
    batch = ticket("b", priority=1)
    queue.offer(0, ticket("a"))
    queue.offer(0, batch)
    assert queue.offer(0, ticket("c")) == [batch]
    refused = ticket("d", priority=1)
    assert queue.offer(0, refused) == [refused]
    assert len(queue) == 2


def test_a_full_queue_sheds_the_long_backlog_not_a_light_tenant_just_served() -> None:
    """The light tenant's counter is above the heavy one's for a moment (it was just served),
    but the queue is full of the heavy tenant's work: a heavy ticket goes."""
    queue = FairQueue(AdmissionConfig(max_queue=3))
    for _ in range(3):
        queue.offer(0, ticket("heavy", prompt_estimate=100))
    light = ticket("light", prompt_estimate=100)
    queue.start(light)
    queue.charge(light, 150, 0)
    newcomer = ticket("light", prompt_estimate=100)
    (shed,) = queue.offer(0, newcomer)
    assert shed.tenant == "heavy"
    assert queue.waiting("light") == 1


def _replicas(running: int, at: float) -> list[ReplicaView]:
    load = ReplicaLoad(running=running, observed_at=at)
    return [ReplicaView(f"r{i}", "m", ReplicaState.READY, load) for i in range(2)]  # type: ignore[arg-type]


def test_saturation_is_the_scrape_or_the_own_count() -> None:
    config = AdmissionConfig()
    assert not pool_saturated([], 100, config, 4)
    assert pool_saturated(_replicas(4, 0.0), 0, config, 4)  # the scrape says full
    assert pool_saturated(_replicas(0, 0.0), 7, config, 4)  # the own count says full
    assert not pool_saturated(_replicas(3, 0.0), 6, config, 4)


def test_a_pool_starts_at_once_below_saturation_then_queues_and_pumps_as_slots_free() -> None:
    """The state machine both shells drive: one replica of two slots, unscraped."""
    pool = PoolAdmission(AdmissionConfig(max_queue=1), 2)
    routable = [ReplicaView("r0", "m", ReplicaState.READY, ReplicaLoad())]  # type: ignore[arg-type]
    a, b, c, d = (ticket(t, deadline=5.0) for t in "abcd")
    assert pool.enter(a, routable)
    assert pool.enter(b, routable)
    assert pool.in_flight == 2
    assert pool.saturated(routable)
    assert not pool.enter(c, routable)
    assert pool.offer(0.0, c) == []
    assert pool.admit(0.0, routable) is None  # full: c waits
    assert not pool.enter(d, routable)  # someone waits: no jumping the queue
    assert pool.offer(0.0, d) == [d]  # and the queue (1) is full
    pool.leave(a, (10, 5))
    assert pool.admit(1.0, routable) is c
    assert pool.in_flight == 2
    assert pool.admit(1.0, routable) is None
    assert pool.queue_max == 1
    late = ticket("e", deadline=2.0)
    pool.offer(1.0, late)
    assert pool.expire(3.0) == [late]
    assert not pool.queue


def test_a_gauge_moves_a_full_scrape_by_the_requests_ended_since() -> None:
    """Without it a scrape taken while the pool was full holds every queued request back
    until the next scrape, however many requests end meanwhile."""
    gauge = PoolGauge(AdmissionConfig(), 4)
    full = _replicas(4, 1.0)
    assert gauge.saturated(full, 8)
    assert not gauge.saturated(full, 6)  # two ended since the scrape
    assert gauge.saturated(full, 8)  # and two started in their place
    assert gauge.saturated(_replicas(4, 2.0), 6)  # a new scrape: the base is 6 now


def test_deadlines_expire_while_queued() -> None:
    queue = FairQueue()
    late = ticket("a", deadline=5.0)
    queue.offer(0, late)
    queue.offer(0, ticket("a", deadline=50.0))
    assert queue.next_deadline() == 5.0
    assert queue.expire(4.0) == []
    assert queue.expire(6.0) == [late]
    assert len(queue) == 1
    gone = ticket("a", deadline=1.0)
    assert queue.offer(2.0, gone) == [gone]


@settings(max_examples=60, deadline=None)
@given(
    heavy_burst=st.integers(5, 60),
    light_every=st.integers(2, 6),
    prompt=st.integers(10, 500),
    output=st.integers(1, 200),
)
def test_a_burst_cannot_starve_a_light_tenant(
    heavy_burst: int, light_every: int, prompt: int, output: int
) -> None:
    """A saturated pool that starts one request per step: the heavy tenant keeps ``heavy_burst``
    requests queued, the light one sends one every ``light_every`` steps. Every light request
    starts within two steps of its arrival, and the heavy tenant is never starved either."""
    queue = FairQueue(AdmissionConfig(max_queue=10_000))
    waits: list[int] = []
    started: Counter[str] = Counter()
    for step in range(400):
        while queue.waiting("heavy") < heavy_burst:
            queue.offer(step, ticket("heavy", prompt_estimate=prompt, arrived=step))
        if step % light_every == 0:
            queue.offer(step, ticket("light", prompt_estimate=prompt, arrived=step))
        t = queue.pop(step)
        assert t is not None
        started[t.tenant] += 1
        queue.charge(t, prompt, output)
        if t.tenant == "light":
            waits.append(step - int(t.arrived))
    assert max(waits) <= 2
    assert started["heavy"] >= 400 * (1 - 1 / light_every) - 5


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=2, max_size=4),
    works=st.lists(st.integers(1, 50), min_size=4, max_size=4),
)
def test_backlogged_tenants_share_by_weight(weights: list[float], works: list[int]) -> None:
    """Always-backlogged tenants get GPU work in proportion to their weights (VTC's bound:
    the counters of backlogged tenants stay within one request's work of each other)."""
    queue = FairQueue(AdmissionConfig(max_queue=10_000, output_weight=1.0))
    served: Counter[str] = Counter()
    names = [f"t{i}" for i in range(len(weights))]
    for name, weight in zip(names, weights, strict=True):
        for _ in range(2):  # one more always waits behind the one started
            queue.offer(0, ticket(name, weight=weight))
    for _ in range(600):
        t = queue.pop(0)
        assert t is not None
        work = works[int(t.tenant[1:])]  # each tenant's requests cost the same
        queue.charge(t, work, 0)
        served[t.tenant] += work
        queue.offer(0, ticket(t.tenant, weight=t.weight))
    per_weight = [served[n] / weights[i] for i, n in enumerate(names)]
    assert max(per_weight) - min(per_weight) <= max(works) + 1e-9
