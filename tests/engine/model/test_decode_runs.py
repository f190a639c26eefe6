"""``ReplicaModel.run_decodes``: a run of pure-decode steps applied at once, as if one by one.

The property: two replicas with the same config and the same arrivals and aborts, one
stepped one step at a time, the other also fast-forwarded with ``run_decodes`` up to random
horizons, agree on everything a shell can observe, every token's time included, and their
state after each run equals the one-by-one state after the same number of steps (stats,
block tables, the free queue in eviction order, the prefix cache's names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import cycle
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpufleet.engine.model import DecodeRun, NewRequest, ReplicaConfig, ReplicaModel

from .factories import make_config, make_replica, request


def snapshot(model: ReplicaModel, ids: list[str]) -> tuple[Any, ...]:
    """Everything observable about the replica between steps (and the pool, for good measure)."""
    model.check_invariants()
    pool = model._kv.pool
    return (
        model.stats(),
        tuple((rid, model.blocks_of(rid)) for rid in ids),
        tuple(pool.free_queue()),
        tuple(pool.block_hash(b) for b in range(pool.num_blocks)),
    )


@dataclass(frozen=True)
class Arrive:
    time: float
    request: NewRequest


@dataclass(frozen=True)
class Abort:
    time: float
    request_id: str
    mid_step: bool
    """Abort between the next plan_step and its finish_step instead of between steps."""


@dataclass
class Observed:
    token_times: dict[str, list[float]] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    finished: dict[str, tuple[float, int, str]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)
    at_events: list[tuple[Any, ...]] = field(default_factory=list)
    """A snapshot each time arrivals or aborts are applied (both replicas are at that step)."""
    after_step: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    """Snapshots by the number of steps done."""
    runs: list[DecodeRun] = field(default_factory=list)
    final: tuple[Any, ...] = ()


class Shell:
    """Steps a replica as a shell would and writes down what it sees."""

    def __init__(self, config: ReplicaConfig, ids: list[str], *, snapshots: bool) -> None:
        self.model = ReplicaModel(config)
        self.ids = ids
        self.snapshots = snapshots
        self.seen = Observed()
        self.now = 0.0
        self.steps = 0

    def apply(self, events: list[Arrive | Abort]) -> list[str]:
        """Arrivals and aborts due by now; returns the ids to abort during the next step."""
        if self.snapshots:
            self.seen.at_events.append(snapshot(self.model, self.ids))
        mid_step = []
        for e in events:
            if isinstance(e, Arrive):
                self.model.add_request(e.request, e.time)
            elif e.mid_step:
                mid_step.append(e.request_id)
            else:
                self.model.abort(e.request_id, self.now)
        return mid_step

    def step(self, mid_step: list[str]) -> None:
        model, seen = self.model, self.seen
        plan = model.plan_step(self.now)
        if plan is None:
            return  # everything was aborted
        for rid in mid_step:
            model.abort(rid, self.now)
        self.now += plan.duration
        self.steps += 1
        seen.durations.append(plan.duration)
        for out in model.finish_step(plan, self.now):
            seen.token_times.setdefault(out.request_id, []).append(self.now)
            if out.first_token:
                seen.first[out.request_id] = self.now
                seen.cached[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                seen.finished[out.request_id] = (self.now, out.num_output_tokens, out.finish_reason)
        if self.snapshots:
            seen.after_step[self.steps] = snapshot(model, self.ids)

    def fast_forward(self, until: float) -> None:
        before = snapshot(self.model, self.ids)
        run = self.model.run_decodes(self.now, until)
        if run is None:
            assert snapshot(self.model, self.ids) == before, "run_decodes changed a replica"
            return
        assert run.first_step == self.steps
        assert run.num_steps >= 1
        self.seen.runs.append(run)
        for duration in run.durations:
            self.now += duration
            self.steps += 1
            self.seen.durations.append(duration)
            for rid in run.request_ids:
                self.seen.token_times[rid].append(self.now)
        assert self.now < until
        if self.snapshots:
            self.seen.after_step[self.steps] = snapshot(self.model, self.ids)


def drive(
    config: ReplicaConfig,
    events: list[Arrive | Abort],
    horizons: list[float] | None,
    *,
    snapshots: bool = True,
) -> Observed:
    """Step the replica as a shell would; with ``horizons``, try a fast-forward after every
    step, up to the next event or ``now + horizon``, whichever is first."""
    shell = Shell(
        config, [e.request.request_id for e in events if isinstance(e, Arrive)], snapshots=snapshots
    )
    tries = cycle(horizons or [math.inf])
    i = 0
    while i < len(events) or shell.model.has_work():
        if not shell.model.has_work():
            shell.now = max(shell.now, events[i].time)
        due = i
        while due < len(events) and events[due].time <= shell.now:
            due += 1
        mid_step = shell.apply(events[i:due]) if due > i else []
        i = due
        shell.step(mid_step)
        if horizons is not None:
            next_event = events[i].time if i < len(events) else math.inf
            shell.fast_forward(min(next_event, shell.now + next(tries)))
    shell.seen.final = snapshot(shell.model, shell.ids)
    return shell.seen


def assert_same(slow: Observed, fast: Observed) -> None:
    assert fast.token_times == slow.token_times
    assert fast.first == slow.first
    assert fast.finished == slow.finished
    assert fast.cached == slow.cached
    assert [d.hex() for d in fast.durations] == [d.hex() for d in slow.durations]
    assert fast.at_events == slow.at_events
    assert fast.final == slow.final
    for steps, state in fast.after_step.items():
        assert state == slow.after_step[steps], f"after {steps} steps"


# -- the property -----------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> tuple[ReplicaConfig, list[Arrive | Abort]]:
    config = make_config(
        num_gpu_blocks_override=draw(st.sampled_from([4, 6, 8, 12, 24, 40])),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_batched_tokens=draw(st.sampled_from([3, 8, 32, 8192])),
        max_num_seqs=draw(st.integers(1, 6)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        output_len_median=draw(st.sampled_from([3.0, 20.0])),
    )
    limit = ReplicaModel(config).max_model_len
    third = max(1, limit // 3)
    events: list[Arrive | Abort] = []
    t = 0.0
    for n in range(draw(st.integers(1, 8))):
        t += draw(st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.05, 0.3]))
        shared = draw(st.sampled_from([0, third // 2, third]))
        own = draw(st.integers(1, third))
        start = 5000 + 1000 * n
        prompt = tuple(range(7, 7 + shared)) + tuple(range(start, start + own))
        new = NewRequest(
            f"r{n}",
            prompt,
            max_tokens=draw(st.integers(1, third)),
            ignore_eos=draw(st.booleans()),
            priority=draw(st.integers(0, 2)),
        )
        events.append(Arrive(t, new))
        if draw(st.integers(0, 5)) == 0:
            later = t + draw(st.sampled_from([0.0, 0.004, 0.02, 0.1]))
            events.append(Abort(later, new.request_id, draw(st.booleans())))
    events.sort(key=lambda e: e.time)  # stable: an abort follows its arrival
    return config, events


horizons = st.lists(
    st.sampled_from([0.0, 0.003, 0.007, 0.02, 0.05, 0.25, math.inf]), min_size=1, max_size=12
)


@settings(max_examples=250, deadline=None)
@given(workload=workloads(), horizons=horizons)
def test_fast_forward_equals_stepping_one_by_one(
    workload: tuple[ReplicaConfig, list[Arrive | Abort]], horizons: list[float]
) -> None:
    config, events = workload
    slow = drive(config, events, None)
    fast = drive(config, events, horizons)
    assert_same(slow, fast)
    ran = sum(run.num_steps for run in fast.runs)
    event(f"steps fast-forwarded: {'none' if not ran else 'some'}")
    event(f"preempted: {slow.final[0].num_preemptions > 0}")


# -- examples ---------------------------------------------------------------------------------


def decoding(model: ReplicaModel, *news: NewRequest) -> float:
    """Add ``news`` at 0 and step until all of them are decoding; returns the time."""
    for new in news:
        model.add_request(new, 0.0)
    now = 0.0
    while True:
        plan = model.plan_step(now)
        assert plan is not None
        now += plan.duration
        model.finish_step(plan, now)
        if plan.batch.prefill_tokens == 0:
            return now


def test_a_run_stops_before_the_step_that_finishes_a_request() -> None:
    model = make_replica()
    now = decoding(model, request("a", 40, max_tokens=30), request("b", 20, max_tokens=12))
    produced = model.stats().generation_tokens // 2
    run = model.run_decodes(now, math.inf)
    assert run is not None
    assert run.request_ids == ("a", "b")
    assert run.num_steps == 12 - produced - 1  # b's last token is an ordinary step
    assert model.run_decodes(now + sum(run.durations), math.inf) is None
    plan = model.plan_step(now + sum(run.durations))
    assert plan is not None
    assert plan.step == run.first_step + run.num_steps
    outputs = model.finish_step(plan, now + sum(run.durations) + plan.duration)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", None), ("b", "length")]


def test_a_run_ends_before_the_horizon_and_the_step_that_reaches_it() -> None:
    model = make_replica()
    now = decoding(model, request("a", 40, max_tokens=200))
    run = model.run_decodes(now, math.inf)
    assert run is not None
    ends = [now]
    for duration in run.durations:
        ends.append(ends[-1] + duration)
    again = make_replica()
    decoding(again, request("a", 40, max_tokens=200))
    short = again.run_decodes(now, ends[5])  # the fifth step ends exactly at the horizon
    assert short is not None
    assert short.durations == run.durations[:4]
    assert again.run_decodes(ends[4], ends[5]) is None


def test_no_run_while_anything_else_must_happen() -> None:
    model = make_replica(max_num_batched_tokens=16)
    model.add_request(request("a", 40, max_tokens=20), 0.0)
    assert model.run_decodes(0.0, math.inf) is None  # waiting
    plan = model.plan_step(0.0)
    assert plan is not None
    with pytest.raises(RuntimeError, match="in flight"):
        model.run_decodes(0.0, math.inf)
    model.finish_step(plan, plan.duration)
    assert model.run_decodes(plan.duration, math.inf) is None  # a prompt chunk is left
    now = decoding(model)
    assert model.run_decodes(now, now) is None  # no step ends before the horizon
    with pytest.raises(ValueError, match="needs times"):
        model.run_decodes(now, math.nan)
    assert model.run_decodes(now, math.inf) is not None
    idle = make_replica()
    assert idle.run_decodes(0.0, math.inf) is None


def test_a_run_stops_where_the_cache_runs_out_and_plan_step_preempts() -> None:
    config = make_config(num_gpu_blocks_override=6, block_size=4)
    a, b = request("a", 6, max_tokens=16), request("b", 5, max_tokens=16)  # 6 blocks each
    events: list[Arrive | Abort] = [Arrive(0.0, a), Arrive(0.0, b)]
    slow = drive(config, events, None)
    fast = drive(config, events, [math.inf])
    assert_same(slow, fast)
    assert fast.runs
    assert slow.final[0].num_preemptions > 0


def _caught_up(
    config: ReplicaConfig, arrivals: list[NewRequest], until: float
) -> tuple[ReplicaModel, float]:
    """A replica given ``arrivals`` at 0 and stepped to its first pure-decode run, that run
    then caught up to ``until`` as the simulator's driver does: the steps that end before
    ``until`` applied, the step in flight at ``until`` planned."""
    model = ReplicaModel(config)
    start = decoding(model, *arrivals)
    run = model.run_decodes(start, until)
    t = start
    for duration in () if run is None else run.durations:
        t += duration
    assert model.plan_step(t) is not None
    return model, start


@pytest.mark.parametrize(
    ("overrides", "lengths"),
    [
        ({}, [(40, 200), (20, 90), (70, 120)]),
        ({"block_size": 4}, [(6, 60), (9, 80), (3, 70), (13, 40)]),
        ({"num_gpu_blocks_override": 12, "block_size": 4}, [(6, 40), (5, 40)]),  # blocks run out
    ],
)
def test_a_run_priced_ahead_answers_for_the_replica_caught_up_anywhere_in_it(
    overrides: dict[str, Any], lengths: list[tuple[int, int]]
) -> None:
    config = make_config(**overrides)
    arrivals = [request(f"r{k}", p, max_tokens=m) for k, (p, m) in enumerate(lengths)]
    model = ReplicaModel(config)
    start = decoding(model, *arrivals)
    ahead = model.decode_run_ahead(start)
    assert ahead is not None
    assert model.decode_run_end(start) == (ahead.end, ahead.steps)
    whole = model.run_decodes(start, math.inf)
    assert whole is not None
    assert ahead.steps == whole.num_steps
    t = start
    for k, duration in enumerate(whole.durations):
        t += duration
        assert ahead.times[k + 1] == t  # summed one by one, as the kernel sums
    times = ahead.times
    instants = {times[0], times[-1], (times[0] + times[-1]) / 2}
    for k in range(1, len(times)):
        instants |= {times[k], (times[k - 1] + times[k]) / 2}
    for now in sorted(instants):
        caught, _ = _caught_up(config, arrivals, now)
        assert ahead.load_at(now) == caught.load(), now
        stats = caught.stats()
        assert caught.load() == (stats.num_running, stats.num_waiting, stats.kv_cache_usage)
    with pytest.raises(ValueError, match="outside the run"):
        ahead.load_at(times[-1] + 1.0)
