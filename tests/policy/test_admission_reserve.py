"""The fair-share reserve: between ``saturation`` and ``reserve_saturation`` only a tenant whose
running and queued requests fit in its weighted fair share of the running ones may start."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.policy import AdmissionConfig, FairQueue, Ticket

_ids = iter(range(10**9))
CONFIG = AdmissionConfig(saturation=0.5, reserve_saturation=0.8, max_queue=10_000)


def ticket(tenant: str, priority: int = 0, weight: float = 1.0, **kw: float) -> Ticket:
    return Ticket(f"{tenant}-{next(_ids)}", tenant, priority, weight, **kw)  # type: ignore[arg-type]


def running(queue: FairQueue, tenant: str, n: int, weight: float = 1.0) -> list[Ticket]:
    started = [ticket(tenant, weight=weight) for _ in range(n)]
    for t in started:
        queue.start(t)
    return started


def test_a_light_tenant_starts_in_the_reserve_and_a_heavy_one_waits() -> None:
    queue = FairQueue(CONFIG)
    running(queue, "heavy", 10)
    for _ in range(5):
        queue.offer(0, ticket("heavy"))
    light = ticket("light")
    queue.offer(0, light)
    assert queue.admit(0, 0.6) is light  # above saturation, in the reserve: light only
    assert queue.admit(0, 0.6) is None  # heavy's backlog never fits its share
    assert queue.admit(0, 0.8) is None  # above the reserve nobody starts
    first = queue.admit(0, 0.4)  # below saturation: the fair order, as pop
    assert first is not None
    assert first.tenant == "heavy"


def test_a_tenant_alone_never_uses_the_reserve() -> None:
    queue = FairQueue(CONFIG)
    running(queue, "only", 3)
    queue.offer(0, ticket("only"))
    assert queue.admit(0, 0.6) is None
    assert not queue.under_share("only")


def test_batch_never_jumps_a_waiting_interactive_ticket_through_the_reserve() -> None:
    queue = FairQueue(CONFIG)
    running(queue, "heavy", 10)
    queue.offer(0, ticket("heavy", priority=0))
    queue.offer(0, ticket("light", priority=1))
    assert queue.under_share("light")
    assert queue.admit(0, 0.6) is None  # the interactive one waits, so batch does too


def test_ended_tickets_leave_the_running_count() -> None:
    queue = FairQueue(CONFIG)
    started = running(queue, "a", 2)
    queue.end(started[0], (100, 10))
    assert queue.running == {"a": 1}
    queue.end(started[1])
    assert queue.running == {}
    assert queue.counters["a"] == 100 + CONFIG.output_weight * 10


def test_weights_scale_the_share() -> None:
    queue = FairQueue(CONFIG)
    running(queue, "big", 6, weight=3.0)
    running(queue, "small", 2)
    queue.offer(0, ticket("big", weight=3.0))
    queue.offer(0, ticket("small"))
    assert not queue.under_share("big")  # asks 7, share 3/4 of 8 running = 6
    assert not queue.under_share("small")  # asks 3, share 1/4 of 8 = 2
    running(queue, "big", 4, weight=3.0)
    assert queue.under_share("small")  # 1/4 of 12 = 3


def test_many_light_tenants_each_fit_their_share() -> None:
    queue = FairQueue(CONFIG)
    running(queue, "heavy", 40)
    for _ in range(40):
        queue.offer(0, ticket("heavy"))
    lights = [ticket(f"light{i}") for i in range(5)]
    for t in lights:
        queue.offer(0, t)
    started = [queue.admit(0, 0.6) for _ in lights]
    assert started == lights  # each asks 1 of its 40/6 share
    assert queue.admit(0, 0.6) is None


Op = tuple[str, int, int]
"""(kind, tenant, class): offer a ticket, end a running one, admit, or expire."""

ops = st.lists(
    st.tuples(
        st.sampled_from(["offer", "offer", "end", "admit", "admit", "expire"]),
        st.integers(0, 3),
        st.integers(0, 1),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    tenants=st.integers(1, 4),
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=4, max_size=4),
    capacity=st.integers(2, 40),
    saturation=st.floats(0.1, 1.0),
    headroom=st.floats(0.0, 0.5),
    max_queue=st.integers(1, 30),
)
def test_the_reserve_is_bounded_fair_and_strict(
    *,
    ops: list[Op],
    tenants: int,
    weights: list[float],
    capacity: int,
    saturation: float,
    headroom: float,
    max_queue: int,
) -> None:
    """Any interleaving of arrivals (with shedding and deadlines), ends and admissions into a
    pool of ``capacity`` slots, its level the running count over it:

    * nothing starts at or above ``reserve_saturation``; with one tenant, nothing at or above
      ``saturation`` (a tenant alone never uses the reserve);
    * what starts in the reserve is of the highest class waiting and of a tenant whose
      running and queued requests fit its weighted share of the running ones;
    * a ticket shed or expired never starts, a started one never expires; the running counts
      are the starts less the ends."""
    config = AdmissionConfig(
        saturation=saturation,
        reserve_saturation=saturation + headroom,
        max_queue=max_queue,
    )
    queue = FairQueue(config)
    live: list[Ticket] = []
    queued: dict[str, Ticket] = {}
    gone: set[str] = set()
    clock = 0.0
    for kind, who, klass in ops:
        clock += 0.1
        tenant = f"t{who % tenants}"
        if kind == "offer":
            new = ticket(tenant, klass, weights[who % tenants], deadline=clock + 1.0)
            queued[new.id] = new
            for shed in queue.offer(clock, new):
                gone.add(queued.pop(shed.id).id)
        elif kind == "end" and live:
            queue.end(live.pop(who % len(live)), (10, 5))
        elif kind == "expire":
            for expired in queue.expire(clock):
                gone.add(queued.pop(expired.id).id)
        elif kind == "admit":
            level = len(live) / capacity
            waiting_classes = {t.priority for t in queued.values()}
            fits = {t: queue.under_share(t) for t in _names(tenants)}
            started = queue.admit(clock, level)
            if started is None:
                continue
            assert started.id not in gone
            del queued[started.id]
            assert level < config.reserve_saturation
            if level >= saturation:
                assert tenants > 1
                assert started.priority == min(waiting_classes)
                assert fits[started.tenant]
            live.append(started)
        expected: dict[str, int] = {}
        for t in live:
            expected[t.tenant] = expected.get(t.tenant, 0) + 1
        assert queue.running == expected
    assert len(live) <= math.ceil(config.reserve_saturation * capacity)


def _names(tenants: int) -> list[str]:
    return [f"t{i}" for i in range(tenants)]


@settings(max_examples=60, deadline=None)
@given(
    heavies=st.integers(1, 4),
    capacity=st.integers(8, 64),
    ends=st.lists(st.integers(0, 10**6), min_size=50, max_size=300),
    light_every=st.integers(1, 5),
)
def test_backlogged_tenants_cannot_climb_into_the_reserve_but_a_light_one_starts_at_once(
    *, heavies: int, capacity: int, ends: list[int], light_every: int
) -> None:
    """Heavy tenants that keep a backlog hold the pool at ``saturation`` and never start in
    the reserve (their demand never fits a share, however their turns fall); a light tenant
    that keeps at most one request queued starts the moment it asks, while the reserve has
    room and what it asks fits its share."""
    config = AdmissionConfig(saturation=0.5, reserve_saturation=0.9, max_queue=10_000)
    queue = FairQueue(config)
    live: list[Ticket] = []
    names = [f"heavy{i}" for i in range(heavies)]
    for step, pick in enumerate(ends):
        for name in names:
            while queue.waiting(name) < capacity:
                queue.offer(step, ticket(name))
        light = None
        if step % light_every == 0 and queue.waiting("light") == 0:
            light = ticket("light")
            queue.offer(step, light)
            fits = queue.under_share("light")
        while (t := queue.admit(step, len(live) / capacity)) is not None:
            live.append(t)
        heavy_running = sum(queue.running.get(n, 0) for n in names)
        assert heavy_running <= math.ceil(config.saturation * capacity)
        if light is not None and fits and len(live) <= config.reserve_saturation * capacity:
            assert light in live
        if live:
            queue.end(live.pop(pick % len(live)))
