"""The chaos run (``gpufleet.sim.chaos_run``): random crash, slow and blackout schedules through
the real pool controller, and the invariants that must hold on every one. CI runs a slice of
the seeds; ``bench/chaos.py`` runs 1,000."""

from __future__ import annotations

import dataclasses

from gpufleet.fleet import ReplicaState
from gpufleet.sim import (
    ErrorFault,
    FleetSimulation,
    RequestLog,
    RequestRecord,
    chaos_run,
    chaos_scenario,
)

SEEDS = range(24)


def test_every_invariant_holds_on_a_slice_of_the_seeds() -> None:
    results = [chaos_run(seed, requests=120) for seed in SEEDS]
    problems = [p for r in results for p in r.problems]
    assert problems == []
    # the seeds do what chaos is for: crashes, ejections, resumed streams and refusals
    assert sum(r.crashes for r in results) >= 10
    assert sum(r.ejections for r in results) >= 3
    assert sum(r.resumed for r in results) >= 10
    assert sum(r.failed for r in results) > 0
    assert {r.scenario.fleet["models"][0]["routing"]["policy"] for r in results} >= {
        "round_robin",
        "least_request",
        "kv_aware",
        "prefix_aware",
    }


def test_a_seed_is_one_scenario_and_one_run() -> None:
    assert chaos_scenario(7) == chaos_scenario(7)
    assert chaos_scenario(7) != chaos_scenario(8)
    a, b = chaos_run(7, requests=80), chaos_run(7, requests=80)
    assert (a.failed, a.routes, a.ejections, a.simulated_s) == (
        b.failed,
        b.routes,
        b.ejections,
        b.simulated_s,
    )


def test_routing_to_an_ejected_replica_is_caught() -> None:
    """Health that still ejects (its records go out) but shows the router every replica READY:
    on the seeds whose live replicas are ejected (5xx answers, not only crashes), the run
    sends requests into ejection windows, and the check says so."""

    def blind_router(sim: FleetSimulation) -> None:
        for pool in sim.control.pools.values():
            decide = pool.health.decide

            def all_ready(now, view, decide=decide):  # type: ignore[no-untyped-def]
                decision = decide(now, view)
                ready = dict.fromkeys(decision.states, ReplicaState.READY)
                return dataclasses.replace(decision, states=ready)

            pool.health.decide = all_ready  # type: ignore[method-assign]

    caught = 0
    for seed in range(8, 14):  # 10, 11 and 13 eject live replicas
        scenario = chaos_scenario(seed, requests=120)
        if not any(isinstance(f, ErrorFault) for f in scenario.faults):
            continue
        problems = chaos_run(seed, requests=120, tamper=blind_router).problems
        caught += any("ejected from" in p for p in problems)
    assert caught >= 2


def test_a_lost_record_and_a_leaked_slot_are_caught() -> None:
    class DroppingLog(RequestLog):
        """Loses the first request that ends."""

        dropped = False

        def append(self, record: RequestRecord) -> None:
            if not DroppingLog.dropped:
                DroppingLog.dropped = True
                return
            super().append(record)

    def lose_one(sim: FleetSimulation) -> None:
        sim.harness.recorder.log = DroppingLog()

    problems = chaos_run(3, requests=60, tamper=lose_one).problems
    assert any("never ended" in p for p in problems), problems

    def leak(sim: FleetSimulation) -> None:
        next(iter(sim.control.pools.values())).active_retries += 1

    problems = chaos_run(3, requests=60, tamper=leak).problems
    assert any("retries in flight after the run" in p for p in problems), problems
