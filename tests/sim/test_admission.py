"""The simulator drives the gateway's ``FairQueue`` in front of routing (sim/_admission.py)."""

from __future__ import annotations

import json
import random

import pytest

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.sim import (
    FleetSimulation,
    SimOptions,
    SimTenant,
    TenantMix,
    TraceRequest,
    parse_tenant,
)

SEQS = 8


def small_fleet(*, auth: bool) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "gpu": "h100-sxm",
                    "replicas": 2,
                    "args": [f"--max-num-seqs={SEQS}"],
                    "routing": "least_request",
                }
            ],
            "tenants": {
                "auth": auth,
                "admission": {"max_queue": 64, "max_wait": 5.0},
            },
        }
    )


def stream(tenant: str, rate: float, duration: float) -> list[TraceRequest]:
    rng = random.Random(tenant)
    t, out = 0.0, []
    while (t := t + rng.expovariate(rate)) < duration:
        out.append(TraceRequest(t, rng.randint(300, 900), rng.randint(50, 150), tenant=tenant))
    return out


def run(requests: list[TraceRequest], *, auth: bool) -> tuple[FleetSimulation, dict]:  # type: ignore[type-arg]
    sim = FleetSimulation(
        small_fleet(auth=auth),
        SimOptions(seed=0, tenants=(SimTenant("light"), SimTenant("heavy"))),
    )
    sim.start(sorted(requests, key=lambda r: r.arrival_s))
    sim.run()
    assert sim.check() == []
    return sim, sim.report({})


def test_the_queue_protects_a_light_tenant_from_a_heavy_one() -> None:
    light, heavy = stream("light", 4.0, 20.0), stream("heavy", 40.0, 20.0)
    _, fair = run(light + heavy, auth=True)
    _, fifo = run(light + heavy, auth=False)
    tenants = fair["tenants"]["tenants"]
    assert fair["tenants"]["admission"]["on"] is True
    assert tenants["heavy"]["queued"] > 0
    assert tenants["heavy"]["shed"] + tenants["heavy"]["expired"] > 0  # over capacity
    assert tenants["light"]["shed"] == tenants["light"]["expired"] == 0
    assert tenants["light"]["served"] == tenants["light"]["requests"] == len(light)
    fair_p99 = tenants["light"]["ttft_s"]["p99"]
    fifo_p99 = fifo["tenants"]["tenants"]["light"]["ttft_s"]["p99"]
    assert fifo["tenants"]["admission"]["on"] is False
    assert fair_p99 * 5 < fifo_p99  # FIFO: the light tenant waits behind the heavy burst
    # Shed and expired requests are error rows (the gateway's 503), counted once.
    assert fair["overall"]["requests"] == len(light) + len(heavy)


def test_admission_reports_are_deterministic() -> None:
    requests = stream("light", 4.0, 5.0) + stream("heavy", 40.0, 5.0)
    first, a = run(requests, auth=True)
    second, b = run(requests, auth=True)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert first.harness.recorder.digest() == second.harness.recorder.digest()


def test_a_mix_assigns_untagged_requests_by_share_and_keeps_tagged_ones() -> None:
    mix = TenantMix([SimTenant("a", share=1), SimTenant("b", share=3)], seed=1)
    drawn = [mix.tenant_of(TraceRequest(0.0, 10, 1)) for _ in range(4000)]
    assert 0.7 < drawn.count("b") / len(drawn) < 0.8
    assert mix.tenant_of(TraceRequest(0.0, 10, 1, tenant="c")) == "c"
    assert mix.settings("c") == SimTenant("c")
    again = TenantMix([SimTenant("a", share=1), SimTenant("b", share=3)], seed=1)
    assert [again.tenant_of(TraceRequest(0.0, 10, 1)) for _ in range(4000)] == drawn


def test_parse_tenant() -> None:
    assert parse_tenant("heavy:share=10,weight=2,priority=batch") == SimTenant(
        "heavy", 10.0, 2.0, "batch"
    )
    assert parse_tenant("light") == SimTenant("light")
    with pytest.raises(ValueError, match="priority"):
        parse_tenant("x:priority=urgent")
    with pytest.raises(ValueError, match="unknown key"):
        parse_tenant("x:color=red")
