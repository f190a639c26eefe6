"""The pool controller in the simulator: the fleet file's routers, stale scrapes, fresh counts."""

from __future__ import annotations

from random import Random

import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.config import parse_fleet
from gpufleet.control import FleetController
from gpufleet.engine.model import ReplicaConfig, ReplicaModel
from gpufleet.fleet import Outcome, ReplicaId, RouteRequest, text_prefix_hashes
from gpufleet.policy import KVAwareRouter, LeastRequestRouter, PrefixAwareRouter, make_router
from gpufleet.sim import (
    FleetHarness,
    FleetSimulation,
    PromptBuilder,
    SimControl,
    SimOptions,
    TraceRequest,
    token_prefix_hashes,
)

MODEL = get_model("llama-3.1-8b")
GPU = get_gpu("h100-sxm")


def replica() -> ReplicaModel:
    return ReplicaModel(ReplicaConfig(MODEL, GPU, num_gpu_blocks_override=512))


POOL = "llama-3.1-8b"


def harness(
    policy: str, replicas: int = 3, interval: float = 0.2
) -> tuple[FleetHarness, SimControl]:
    """A harness and its (not yet attached) controller shell: ``h.start(trace)``, then
    ``control.attach(h)``."""
    fleet = parse_fleet({"models": [{"name": POOL, "replicas": replicas, "routing": policy}]})
    control = SimControl(
        FleetController.of(fleet, seed=0, admission=False), [replicas], scrape_interval=interval
    )
    h = FleetHarness([replica() for _ in range(replicas)], PromptBuilder(MODEL.vocab_size))
    return h, control


def test_token_prefix_hashes_chain_like_the_gateway_text_hashes() -> None:
    a = tuple(range(1000))
    b = a[:300] + tuple(range(5000, 5700))
    ha, hb = token_prefix_hashes(a), token_prefix_hashes(b)
    assert len(ha) == 1000 // 128  # full blocks only; the tail is not hashed
    assert ha[:2] == hb[:2]  # 300 shared ids: two whole 128-id blocks
    assert ha[2] != hb[2]
    assert ha[3:] != hb[3:]
    assert token_prefix_hashes(a) == ha  # integer hashes are not salted: stable
    # The same shape as the gateway's: one hash per block, chained.
    text = "x" * 1000
    assert len(text_prefix_hashes(text)) == 1000 // 512


def test_the_fleet_file_router_is_the_policy_object_and_hears_every_end() -> None:
    h, control = harness("least_request")
    pool = control.control.pools[POOL]
    assert isinstance(pool.router, LeastRequestRouter)
    trace = [TraceRequest(0.0, 200, 50) for _ in range(6)]
    h.start(trace)
    control.attach(h)
    h.run(until=1e-9)
    # Six requests at one instant, least request with fresh counts: two per replica.
    counts = pool.router.snapshot().load.in_flight
    assert sorted(counts.values()) == [2, 2, 2]
    assert sorted(pool.attempts.values()) == [2, 2, 2]  # the controller's own count
    h.run()
    assert h.live == 0
    assert dict(pool.router.snapshot().load.in_flight) == {}
    assert pool.attempts == {}
    assert pool.counters.routed == 6


def test_same_decisions_as_the_router_driven_by_hand() -> None:
    """Replaying the shell's calls on a fresh router from the same seed gives the same picks."""
    h, control = harness("least_request", replicas=2)
    trace = [TraceRequest(0.05 * i, 100 + i, 5 + i % 7) for i in range(20)]
    h.start(trace)
    control.attach(h)
    h.run()
    picks = {r.index: r.replica for r in h.recorder.log}
    ends = sorted((r.finish_s, r.index) for r in h.recorder.log)
    router = make_router("least_request", Random(0))
    view = control.control.pools[POOL].view
    events = sorted(
        [(t.arrival_s, 0, i) for i, t in enumerate(trace)] + [(t, 1, i) for t, i in ends],
    )
    ids = [ReplicaId("llama-3.1-8b-0"), ReplicaId("llama-3.1-8b-1")]
    for time, kind, i in events:
        request = RouteRequest(str(i), "llama-3.1-8b", prompt_tokens=trace[i].input_tokens)
        if kind == 0:
            chosen = router.rank(time, request, view).first()
            assert chosen == ids[picks[i]], i
            router.on_request_start(time, request, chosen)
        else:
            router.on_request_end(time, request, ids[picks[i]], Outcome.SUCCESS)


def test_kv_aware_reads_scrapes_every_interval_and_no_sooner() -> None:
    h, routing = harness("kv_aware", interval=0.5)
    pool = routing.control.pools[POOL]
    assert isinstance(pool.router, KVAwareRouter)
    h.start([TraceRequest(0.01 * i, 3000, 400) for i in range(30)])
    routing.attach(h)
    h.run(until=0.3)
    view = pool.view
    assert view.now == 0.0  # the scrape at 0 is the latest: nothing in it yet
    assert all(r.load.running == 0 and r.load.observed_at == 0.0 for r in view.replicas())
    h.run(until=0.6)
    assert pool.view.now == 0.5
    loads = [r.load for r in pool.view.replicas()]
    assert sum(load.running + load.waiting for load in loads) == 30
    assert all(load.kv_cache_usage > 0 for load in loads)
    h.run()
    assert routing.scrapes >= 2
    assert h.live == 0


def test_round_robin_pools_are_not_scraped() -> None:
    h, routing = harness("round_robin")
    h.start([TraceRequest(0.1 * i, 100, 10) for i in range(9)])
    routing.attach(h)
    h.run()
    assert routing.scrapes == 0
    assert sorted(r.replica for r in h.recorder.log) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_prefix_aware_sends_a_shared_prefix_back_to_its_replica() -> None:
    h, routing = harness("prefix_aware", replicas=4)
    pool = routing.control.pools[POOL]
    assert isinstance(pool.router, PrefixAwareRouter)
    trace = [TraceRequest(0.5 * i, 1100, 5, (7, 8, 9 + i)) for i in range(8)]
    h.start(trace)
    routing.attach(h)
    h.run()
    assert len({r.replica for r in h.recorder.log}) == 1
    assert pool.counters.matched_blocks == 7 * 8  # two shared 512-token blocks = 8 hash blocks
    assert sum(r.cached_tokens for r in h.recorder.log) == 7 * 1024


def test_multi_model_fleets_route_by_the_trace_model_else_the_first() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {"name": "llama-3.1-8b", "replicas": 2, "routing": "least_request"},
                {"name": "qwen2.5-7b", "gpu": "l40s", "replicas": 1, "routing": "kv_aware"},
            ]
        }
    )
    sim = FleetSimulation(fleet, SimOptions(sample_interval=0.5))
    trace = [
        TraceRequest(0.1, 100, 5, model="qwen2.5-7b"),
        TraceRequest(0.2, 100, 5),
        TraceRequest(0.3, 100, 5, model="gpt-4"),
        TraceRequest(0.4, 100, 5, model="qwen2.5-7b"),
    ]
    sim.start(trace)
    sim.run()
    where = {r.index: sim.replica_models[r.replica] for r in sim.harness.recorder.log}
    assert where == {0: "qwen2.5-7b", 1: "llama-3.1-8b", 2: "llama-3.1-8b", 3: "qwen2.5-7b"}
    report = sim.report({})
    assert report["models"]["qwen2.5-7b"]["requests"] == 2
    assert report["cost"]["models"]["qwen2.5-7b"]["gpu"] == "l40s"


def test_engine_flags_in_args_reach_the_replica_model() -> None:
    fleet = parse_fleet(
        {"models": [{"name": "llama-3.1-8b", "replicas": 1, "args": ["--max-num-seqs", "4"]}]}
    )
    sim = FleetSimulation(fleet)
    assert sim.harness.drivers[0].model.config.max_num_seqs == 4
    bad = parse_fleet({"models": [{"name": "llama-3.1-8b", "args": ["--fault-hang"]}]})
    with pytest.raises(ValueError, match="not modelled"):
        FleetSimulation(bad)


def test_engine_fields_reach_the_replica_model_and_args_win_over_them() -> None:
    entry = {
        "name": "llama-3.1-8b",
        "replicas": 1,
        "gpu_memory_utilization": 0.8,
        "max_model_len": 4096,
        "prefix_caching": False,
    }
    config = FleetSimulation(parse_fleet({"models": [entry]})).harness.drivers[0].model.config
    assert (config.gpu_memory_utilization, config.max_model_len) == (0.8, 4096)
    assert config.enable_prefix_caching is False
    flags = ["--max-model-len", "2048", "--enable-prefix-caching"]
    fleet = parse_fleet({"models": [{**entry, "args": flags}]})
    config = FleetSimulation(fleet).harness.drivers[0].model.config
    assert (config.max_model_len, config.enable_prefix_caching) == (2048, True)


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_aware", "least_request"])
def test_fast_forward_changes_nothing_under_policy_routing(policy: str) -> None:
    fleet = parse_fleet({"models": [{"name": "llama-3.1-8b", "replicas": 3, "routing": policy}]})
    rng = Random(11)
    trace, t = [], 0.0
    for _ in range(80):
        t += rng.expovariate(30.0)
        hashes = (rng.randrange(3), rng.randrange(6)) if rng.random() < 0.5 else ()
        trace.append(TraceRequest(t, rng.randrange(20, 1400), rng.randrange(1, 90), hashes))

    def run(fast_forward: bool) -> tuple[str, dict[str, object]]:
        sim = FleetSimulation(fleet, SimOptions(sample_interval=0.25, fast_forward=fast_forward))
        sim.start(trace)
        sim.run()
        return sim.harness.recorder.digest(), sim.report({})

    fast, slow = run(True), run(False)
    assert fast[0] == slow[0]
    assert fast[1] == slow[1]
