"""A request with a latency budget among its served name's variants (control/_served.py,
``within_budget``; ``FleetController.predict_ttft``): the pool on the cheapest GPUs
predicted to meet it, else the fastest; without a budget, or without the performance
model's speeds, the weighted split as before (no shell, explicit ``now``)."""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.config import parse_fleet
from gpufleet.control import (
    Arrived,
    Finished,
    FleetController,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.control._served import within_budget
from gpufleet.engine.model import prefill_seconds_per_token
from gpufleet.fleet import RouteRequest
from gpufleet.sim import replica_config
from tests.control.test_served import pool, pool_of, up

FLEET = parse_fleet(
    {
        "models": [pool("fast", gpu="h100-sxm"), pool("cheap", gpu="l40s")],
        "served": [{"name": "chat", "variants": {"fast": 1, "cheap": 1}}],
    }
)
SPEEDS = {m.name: prefill_seconds_per_token(replica_config(m, 0)) for m in FLEET.models}
"""About 25 µs per prompt token on an H100, 68 on an L40S (Llama-3.1-8B)."""


def budgeted(speeds: dict[str, float] | None = SPEEDS) -> FleetController:
    control = FleetController.of(FLEET, prefill_s=speeds)
    up(control)
    return control


def send(control: FleetController, rid: str, budget: float | None, tokens: int = 2000) -> str:
    request = RouteRequest(rid, "chat", prompt_tokens=tokens)
    (route,) = control.handle(0.0, Arrived(request, budget=budget))
    return pool_of(route)


def test_a_loose_budget_goes_to_the_cheap_gpus_and_a_tight_one_to_the_fast() -> None:
    control = budgeted()
    assert SPEEDS["fast"] * 2000 < 0.1 < SPEEDS["cheap"] * 2000  # 49 ms and 137 ms
    assert {send(control, f"loose-{i}", 1.0) for i in range(20)} == {"cheap"}
    assert {send(control, f"tight-{i}", 0.1) for i in range(20)} == {"fast"}


def test_a_budget_no_pool_meets_goes_to_the_fastest() -> None:
    assert send(budgeted(), "r", 0.001) == "fast"


def test_a_full_pool_is_predicted_slower() -> None:
    """Loose budgets fill the cheap pool's slots twice over (each goes there while it is
    predicted within the budget): a budget it would meet idle then goes to the fast pool."""
    control = budgeted()
    cheap = control.pools["cheap"]
    slots = len(cheap.routable()) * cheap.settings.max_num_seqs
    assert {send(control, f"bg-{i}", 10.0, tokens=10) for i in range(2 * slots)} == {"cheap"}
    assert control.predict_ttft("cheap", 2000) >= 2 * SPEEDS["cheap"] * 2000
    assert send(control, "r", 0.2) == "fast"  # idle, the cheap pool would meet 0.2 s


def test_without_a_budget_or_speeds_the_weighted_split_holds() -> None:
    unbudgeted = {send(budgeted(), f"r{i}", None) for i in range(40)}
    no_speeds = {send(budgeted(None), f"r{i}", 0.1) for i in range(40)}
    assert unbudgeted == no_speeds == {"fast", "cheap"}


def test_the_budget_is_recorded_and_replays_to_the_same_routes() -> None:
    control = FleetController.of(FLEET, prefill_s=SPEEDS)
    control.record(out := io.StringIO())
    up(control)
    for i in range(10):
        send(control, f"r{i}", 0.1 if i % 2 else 1.0)
        control.handle(0.0, Finished("chat", f"r{i}"))
    head, lines = read_recording(io.StringIO(out.getvalue()))
    assert head["prefill_s"] == SPEEDS
    replayed = list(replay(head, lines))
    budgets = [e.budget for line, _ in replayed if isinstance(e := line.event, Arrived)]
    assert budgets == [1.0, 0.1] * 5
    for line, commands in replayed:
        assert commands == line.commands, line
    event = Arrived(RouteRequest("x", "chat", prompt_tokens=5), budget=0.25)
    assert event_from_json(event_to_json(event)) == event


_CANDIDATES = st.lists(
    st.tuples(st.sampled_from("abcdef"), st.sampled_from([0.0, 1.0, 2.0])),
    min_size=1,
    max_size=6,
    unique_by=lambda c: c[0],
)


@settings(max_examples=300, deadline=None)
@given(
    _CANDIDATES,
    st.floats(0.001, 10.0),
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0.0, 5.0)),
    st.dictionaries(st.sampled_from("abcdef"), st.floats(0.0, 10.0)),
)
def test_the_choice_meets_the_budget_cheapest_or_is_the_fastest(
    candidates: list[tuple[str, float]],
    budget: float,
    predicted: dict[str, float],
    prices: dict[str, float],
) -> None:
    def predict(p: str) -> float:
        return predicted.get(p, float("inf"))

    def price(p: str) -> float:
        return prices.get(p, 1.0)

    chosen = within_budget(candidates, budget, predict, price)
    weighted = [p for p, w in candidates if w > 0] or [p for p, _ in candidates]
    known = [p for p in weighted if p in predicted]
    if not known:
        assert chosen is None
        return
    assert chosen in known
    meeting = [p for p in known if predict(p) <= budget]
    if meeting:
        assert predict(chosen) <= budget
        assert price(chosen) == min(price(p) for p in meeting)
    else:
        assert predict(chosen) == min(predict(p) for p in known)
