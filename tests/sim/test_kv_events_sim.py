"""KV events in the fleet simulator: the modelled engines feed the same controller rule."""

from __future__ import annotations

import io
from random import Random

from gpufleet.config import parse_fleet
from gpufleet.control import KvEvents, read_recording, replay
from gpufleet.engine.model import external_hash
from gpufleet.policy import PrecisePrefixRouter
from gpufleet.sim import CrashFault, FleetSimulation, SimOptions, TraceRequest

POOL = "llama-3.1-8b"


def _fleet(policy: str, replicas: int = 3, blocks: int = 400) -> object:
    model = {
        "name": POOL,
        "replicas": replicas,
        "routing": policy,
        "args": ["--num-gpu-blocks-override", str(blocks)],  # 6,400 tokens: caches evict
        "max_model_len": 4096,
    }
    return parse_fleet({"models": [model]})


def _trace(n: int = 160, seed: int = 5) -> list[TraceRequest]:
    """Conversations behind 10 shared system prompts (Mooncake-style 512-token blocks)."""
    rng = Random(seed)
    trace, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(8.0)
        family = rng.randrange(10)
        shared = (1000 + family, 2000 + family)
        turn = tuple(100_000 + i * 10 + k for k in range(rng.randrange(0, 3)))
        hashes = shared + turn
        trace.append(TraceRequest(t, 512 * len(hashes) + rng.randrange(1, 200), 20, hashes))
    return trace


def _run(policy: str, **options: object) -> FleetSimulation:
    sim = FleetSimulation(_fleet(policy), SimOptions(sample_interval=0.5, **options))  # type: ignore[arg-type]
    sim.start(_trace())
    sim.run()
    return sim


def _router(sim: FleetSimulation) -> PrecisePrefixRouter:
    router = sim.control.pools[POOL].router
    assert isinstance(router, PrecisePrefixRouter)
    return router


def test_the_index_is_exactly_what_the_modelled_engines_cache() -> None:
    sim = _run("prefix_precise")
    router = _router(sim)
    feeds = router.snapshot().feeds
    assert len(feeds) == 3
    for k, replica in enumerate(sim.replica_ids):
        feed = feeds[replica]
        assert feed.resync_from is None
        assert feed.applied > 10
        cached = {external_hash(h) for h in sim.harness.drivers[k].model._kv.pool._cached}
        held = {h for h in cached if router.kv.holds(replica, h)}
        assert held == cached
        assert router.kv.size(replica) == len(cached)  # and nothing the engine dropped
    router.check()
    assert sim.control.pools[POOL].counters.matched_blocks > 0


def test_precise_routing_keeps_at_least_the_approximate_hit_rate() -> None:
    approximate = _run("prefix_aware").report({})["overall"]["prefix_hit_rate"]
    precise = _run("prefix_precise").report({})["overall"]["prefix_hit_rate"]
    assert precise >= approximate, (precise, approximate)


def test_one_seed_one_run_fast_forward_or_not_and_a_recording_replays() -> None:
    digests = {_run("prefix_precise", fast_forward=ff).harness.recorder.digest() for ff in (1, 0)}
    assert len(digests) == 1
    sim = FleetSimulation(_fleet("prefix_precise"), SimOptions(sample_interval=0.5))
    out = io.StringIO()
    sim.control.record(out)
    sim.start(_trace(60))
    sim.run()
    head, body = read_recording(io.StringIO(out.getvalue()))
    lines = list(replay(head, body))
    assert sum(isinstance(r.event, KvEvents) for r, _ in lines) > 20
    for recorded, again in lines:
        assert recorded.commands == again


def test_a_restarted_replica_starts_with_an_empty_index_no_ghosts() -> None:
    crash = CrashFault(replica=f"{POOL}-0", at=8.0, startup_s=2.0)
    sim = FleetSimulation(
        _fleet("prefix_precise"), SimOptions(sample_interval=0.5, faults=(crash,))
    )
    sim.start(_trace())
    sim.run(until=9.0)  # down: the index already forgot its old process's blocks
    router = _router(sim)
    replica = sim.replica_ids[0]
    assert router.kv.size(replica) == 0
    sim.run()
    feed = router.snapshot().feeds[replica]
    assert feed.incarnation == "1"  # the new process's feed
    cached = {external_hash(h) for h in sim.harness.drivers[0].model._kv.pool._cached}
    assert router.kv.size(replica) == len(cached)
    assert all(router.kv.holds(replica, h) for h in cached)
