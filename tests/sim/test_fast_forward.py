"""The fast-forward: the same recorded results to the byte, with far fewer kernel events.

Each workload runs twice through the harness, stepping one kernel event at a time and with
the replicas fast-forwarding their pure-decode runs between arrivals, and the two
``Recorder.digest()`` must be equal: every request's row (first-token and finish times,
token counts, cache hits) in the same order and every inter-token gap in each replica's
histogram.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.config import parse_fleet
from gpufleet.engine.model import ReplicaConfig, ReplicaModel
from gpufleet.sim import (
    ArrivalProcess,
    FleetHarness,
    FleetSimulation,
    PromptBuilder,
    SimOptions,
    TraceRequest,
    load_trace,
    parse_fault,
)

MODEL = get_model("llama-3.1-8b")
GPU = get_gpu("h100-sxm")
AZURE = (
    Path(__file__).resolve().parents[3]
    / "shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
)


def synthetic(seed: int, rows: int, rate: float) -> list[TraceRequest]:
    """Bursty arrivals, long and short prompts, some sharing prefixes, a few long answers."""
    rng = random.Random(seed)
    times = ArrivalProcess(rate, cv=2.0).times(rng)
    trace = []
    for _ in range(rows):
        hashes = (rng.randrange(3), rng.randrange(40)) if rng.random() < 0.4 else ()
        output = rng.randrange(1, 60) if rng.random() < 0.8 else rng.randrange(100, 400)
        trace.append(TraceRequest(next(times), rng.randrange(1, 1200), output, hashes))
    return trace


def simulate(
    trace: Iterable[TraceRequest],
    *,
    fast_forward: bool,
    replicas: int = 3,
    slices: Sequence[float] = (),
    **overrides: Any,
) -> FleetHarness:
    fields: dict[str, Any] = {"model": MODEL, "gpu": GPU, "num_gpu_blocks_override": 512}
    fields.update(overrides)
    models = [ReplicaModel(ReplicaConfig(**fields)) for _ in range(replicas)]
    harness = FleetHarness(models, PromptBuilder(MODEL.vocab_size), fast_forward=fast_forward)
    harness.start(trace)
    for until in slices:
        harness.run(until)
    harness.run()
    return harness


WORKLOADS = {
    "roomy": {},
    "preempting": {"num_gpu_blocks_override": 96},
    "chunked": {"max_num_batched_tokens": 256, "max_num_seqs": 6},
    "priority, small blocks": {"scheduling_policy": "priority", "block_size": 4},
    "no prefix caching": {"enable_prefix_caching": False, "num_gpu_blocks_override": 128},
}


@pytest.mark.parametrize("overrides", WORKLOADS.values(), ids=WORKLOADS.keys())
@pytest.mark.parametrize("seed", [1, 2])
def test_fast_forward_gives_byte_identical_results(overrides: dict[str, Any], seed: int) -> None:
    trace = synthetic(seed, rows=150, rate=12.0)
    slow = simulate(trace, fast_forward=False, **overrides)
    fast = simulate(trace, fast_forward=True, **overrides)
    assert fast.recorder.digest() == slow.recorder.digest()
    assert len(fast.recorder.log) == len(trace)
    assert [d.steps for d in fast.drivers] == [d.steps for d in slow.drivers]
    assert [d.busy_s for d in fast.drivers] == [d.busy_s for d in slow.drivers]
    assert [d.model.stats() for d in fast.drivers] == [d.model.stats() for d in slow.drivers]
    # It did fast-forward, and each fast step spared a kernel event (a deferred run whose
    # replica was looked at before its end leaves a stale RunEnd: one event back).
    fast_steps = sum(d.fast_steps for d in fast.drivers)
    stale = sum(d.stale_events for d in fast.drivers)
    assert fast_steps > 0
    assert all(d.fast_steps == 0 for d in slow.drivers)
    assert fast.kernel.events_processed == slow.kernel.events_processed - fast_steps + stale
    # One ITL count per token after the first, fast steps included.
    itl = fast.recorder.itl
    assert itl.count == sum(r.output_tokens - 1 for r in fast.recorder.log if not r.rejected)
    stats = [d.model.stats() for d in slow.drivers]
    if overrides is WORKLOADS["preempting"]:
        assert sum(s.num_preemptions for s in stats) > 0
    if overrides is WORKLOADS["roomy"]:
        assert sum(s.prefix_cache_hits for s in stats) > 0


def test_slices_do_not_change_the_results() -> None:
    """``run(until)`` bounds the fast-forward: when it returns, no replica is ahead of it."""
    trace = synthetic(3, rows=80, rate=8.0)
    cuts = [0.5, 0.5, 1.25, 3.0, 7.5]
    slow, fast = simulate([], fast_forward=False), simulate([], fast_forward=True)
    slow.start(trace)
    fast.start(trace)
    for cut in cuts:
        slow.run(cut)
        fast.run(cut)
        assert fast.kernel.now == slow.kernel.now == cut
        assert [d.steps for d in fast.drivers] == [d.steps for d in slow.drivers]
        assert [d.model.stats() for d in fast.drivers] == [d.model.stats() for d in slow.drivers]
    slow.run()
    fast.run()
    assert fast.recorder.digest() == slow.recorder.digest()
    assert sum(d.fast_steps for d in fast.drivers) > 0


def test_a_long_decode_alone_is_one_run() -> None:
    trace = [TraceRequest(0.0, 500, 2000)]
    slow = simulate(trace, fast_forward=False, replicas=1)
    fast = simulate(trace, fast_forward=True, replicas=1)
    assert fast.recorder.digest() == slow.recorder.digest()
    driver = fast.drivers[0]
    assert driver.fast_runs == 1
    assert driver.fast_steps == driver.steps - 2  # the prefill and the last token
    assert fast.kernel.events_processed == 4  # the arrival, the start, two step ends


@pytest.mark.skipif(not AZURE.exists(), reason=f"{AZURE} is not here")
def test_the_azure_trace_first_minutes_give_the_same_digest() -> None:
    def run(fast_forward: bool) -> FleetHarness:
        trace = load_trace(AZURE, duration=90.0)
        return simulate(trace, fast_forward=fast_forward, replicas=8, num_gpu_blocks_override=None)

    slow, fast = run(False), run(True)
    assert fast.recorder.digest() == slow.recorder.digest()
    assert sum(d.fast_steps for d in fast.drivers) > 0.8 * sum(d.steps for d in fast.drivers)


def test_runs_past_the_next_arrival_elsewhere_are_deferred_not_cut() -> None:
    """Twenty replicas, an arrival every 10 ms somewhere, each replica's every 200 ms: its
    decode runs span the arrivals that go elsewhere (a run is deferred, and caught up only
    when a request comes to it), so most steps are still fast and few are kernel events."""
    trace = [TraceRequest(0.01 * i, 200 + 7 * i, 300) for i in range(200)]
    slow = simulate(trace, fast_forward=False, replicas=20)
    fast = simulate(trace, fast_forward=True, replicas=20)
    assert fast.recorder.digest() == slow.recorder.digest()
    assert [d.busy_s for d in fast.drivers] == [d.busy_s for d in slow.drivers]
    steps = sum(d.steps for d in fast.drivers)
    fast_steps = sum(d.fast_steps for d in fast.drivers)
    stale = sum(d.stale_events for d in fast.drivers)
    assert fast_steps > 0.6 * steps  # cut at every arrival, hardly any would be (10 ms)
    assert stale > 0  # some runs were caught up by a request before they ended
    assert fast.kernel.events_processed == slow.kernel.events_processed - fast_steps + stale


@pytest.mark.parametrize("policy", ["kv_aware", "least_request"])
def test_faults_samples_and_scrapes_change_nothing_under_the_fast_forward(policy: str) -> None:
    """Everything that looks at a replica from outside (a scrape, a sample, a crash, a slow
    fault) first catches its deferred run up: the results are those of stepping."""
    entry = {"name": "llama-3.1-8b", "replicas": 3, "routing": policy}
    fleet = parse_fleet({"models": [entry]}, source="test")
    faults = tuple(
        parse_fault(spec)
        for spec in (
            "crash:replica=llama-3.1-8b-1,at=6,startup_s=4",
            "slow:replica=llama-3.1-8b-0,factor=3,from=3,to=9",
            "blackout:replica=llama-3.1-8b-2,from=2,to=8",
        )
    )
    rng = random.Random(5)
    trace, t = [], 0.0
    for _ in range(150):
        t += rng.expovariate(12.0)
        trace.append(TraceRequest(t, rng.randrange(20, 1400), rng.randrange(1, 200)))

    def run(fast_forward: bool) -> tuple[str, str]:
        options = SimOptions(seed=2, sample_interval=0.7, faults=faults, fast_forward=fast_forward)
        sim = FleetSimulation(fleet, options)
        sim.start(trace)
        for cut in (1.0, 4.5, 8.25):
            sim.run(cut)
        sim.run()
        assert sim.check() == []
        return sim.harness.recorder.digest(), json.dumps(sim.report({}))

    assert run(True) == run(False)
