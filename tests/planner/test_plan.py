"""The planner on hand-made specs: sizing arithmetic, parallelism choice, ranking, warnings."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.catalog import Interconnect, LinkKind
from gpufleet.perf import Dtype
from gpufleet.planner import SLO, FleetPolicy, PlanError, PlanRequest, Workload, plan, plan_gpu
from tests.factories import make_70b, make_gpu, make_model

PCIE = Interconnect(kind=LinkKind.PCIE, pcie_gb_s=32.0)


def _request(**fields: object) -> PlanRequest:
    return PlanRequest.model_validate(fields)


def test_70b_fp16_needs_two_gpus_and_gets_a_reason() -> None:
    result = plan_gpu(make_70b(), make_gpu(), _request(weights_dtype=Dtype.FP16))
    assert result.min_gpus_per_replica == 2
    assert result.gpus_per_replica is not None
    assert result.gpus_per_replica >= 2
    assert "at least 2 GPUs" in result.reason
    tp1 = next(c for c in result.candidates if c.tp == 1 and c.pp == 1)
    assert not tp1.fits
    assert "GiB usable" in tp1.note


def test_replica_count_covers_peak_at_target_utilization_plus_spare() -> None:
    request = _request(
        workload=Workload(rps=40, input_tokens=1000, output_tokens=200, peak_to_mean=1.5),
        fleet=FleetPolicy(target_utilization=0.65, redundancy=1),
    )
    result = plan_gpu(make_model(), make_gpu(), request)
    assert result.status == "meets_slo"
    assert result.replicas is not None
    assert result.throughput is not None
    per_replica = result.throughput.requests_per_s
    expected = math.ceil(60 / (per_replica * 0.65))
    assert result.replicas.for_peak == expected
    assert result.replicas.total == expected + 1
    assert result.replicas.utilization_at_peak <= 0.65 + 1e-9
    assert result.gpus_total == result.replicas.total * (result.gpus_per_replica or 0)


def test_cost_per_token_follows_price_and_load() -> None:
    request = _request(workload=Workload(rps=10, input_tokens=1000, output_tokens=200))
    base = plan_gpu(make_model(), make_gpu(), request)
    pricier = plan_gpu(make_model(), make_gpu(price_per_hour_usd=6.0), request)
    assert base.cost is not None
    assert pricier.cost is not None
    assert pricier.cost.per_hour_usd == pytest.approx(2 * base.cost.per_hour_usd)
    tokens_per_hour = 10 * 1200 * 3600
    assert base.cost.per_million_tokens_usd == pytest.approx(
        base.cost.per_hour_usd / tokens_per_hour * 1e6, rel=1e-3
    )


def test_operating_point_meets_the_slo_it_was_chosen_for() -> None:
    slo = SLO(ttft_p99_ms=800, tpot_p50_ms=30, tpot_p99_ms=60)
    result = plan_gpu(make_model(), make_gpu(), _request(slo=slo))
    assert result.status == "meets_slo"
    assert result.latency is not None
    assert result.latency.ttft_p99_ms <= 800
    assert result.latency.tpot_p50_ms <= 30
    assert result.latency.tpot_p99_ms <= 60


def test_tighter_tpot_means_smaller_batches_and_more_replicas() -> None:
    loose = plan_gpu(make_model(), make_gpu(), _request(slo=SLO(tpot_p50_ms=100)))
    tight = plan_gpu(make_model(), make_gpu(), _request(slo=SLO(tpot_p50_ms=25)))
    assert loose.throughput is not None
    assert tight.throughput is not None
    assert tight.throughput.concurrency < loose.throughput.concurrency
    assert tight.replicas is not None
    assert loose.replicas is not None
    assert tight.replicas.total >= loose.replicas.total


def test_unreachable_slo_is_reported_not_hidden() -> None:
    report = plan(make_model(), [make_gpu()], _request(slo=SLO(tpot_p50_ms=0.5)))
    assert report.recommended is None
    only = report.plans[0]
    assert only.status == "misses_slo"
    assert "TPOT p50" in only.reason
    assert only.replicas is None
    assert only.cost is None
    assert only.latency is not None  # what one request at a time would see


def test_ranking_puts_the_cheapest_that_meets_the_slo_first() -> None:
    cheap = make_gpu(name="cheap", price_per_hour_usd=1.0)
    dear = make_gpu(name="dear", price_per_hour_usd=9.0)
    tiny = make_gpu(name="tiny", memory_gib=2.0)
    report = plan(make_model(), [dear, tiny, cheap], _request())
    assert [p.gpu for p in report.plans] == ["cheap", "dear", "tiny"]
    assert report.recommended == "cheap"
    assert report.plans[-1].status == "does_not_fit"


def test_a_model_that_fits_nowhere_is_an_error() -> None:
    small = make_gpu(name="small", memory_gib=8.0)
    with pytest.raises(PlanError, match="fits on none of: small"):
        plan(make_70b(), [small], _request(fleet=FleetPolicy(gpus_per_node=1)))


def test_tensor_parallel_over_pcie_is_warned_about() -> None:
    pcie = make_gpu(name="pcie-card", memory_gib=48.0, interconnect=PCIE)
    result = plan_gpu(make_70b(), pcie, _request(weights_dtype=Dtype.FP16))
    assert result.tp is not None
    assert result.tp > 1
    assert any("PCIe" in w for w in result.warnings)


def test_rack_power_past_air_cooling_is_warned_about() -> None:
    hot = plan_gpu(make_model(), make_gpu(), _request())  # 4 x 8 x (700 + 575) W = 40.8 kW
    assert hot.power is not None
    assert hot.power.kw_per_rack == pytest.approx(40.8)
    assert not hot.power.air_cooling_ok
    assert any("air cooling" in w for w in hot.warnings)
    cool = plan_gpu(make_model(), make_gpu(tdp_watts=350.0, interconnect=PCIE), _request())
    assert cool.power is not None
    assert cool.power.air_cooling_ok
    assert cool.power.kw_per_replica == pytest.approx(0.55)


@settings(max_examples=25, deadline=None)
@given(low=st.floats(0.5, 50), factor=st.floats(1.0, 10))
def test_more_load_never_needs_fewer_replicas(low: float, factor: float) -> None:
    small = plan_gpu(make_model(), make_gpu(), _request(workload=Workload(rps=low)))
    big = plan_gpu(make_model(), make_gpu(), _request(workload=Workload(rps=low * factor)))
    assert small.replicas is not None
    assert big.replicas is not None
    assert big.replicas.total >= small.replicas.total
