"""``gpufleet plan`` with a batch job: spare capacity first, then spot, priced against
on-demand (``planner/_batch.py``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.catalog import get_gpu, get_model
from gpufleet.planner import BatchReport, BatchWorkload, PlanRequest, Workload, plan

MODEL = get_model("llama-3.1-8b")
GPUS = [get_gpu("h100-sxm"), get_gpu("l40s")]


def batch_of(**fields: object) -> BatchReport:
    request = PlanRequest(workload=Workload(rps=20.0), batch=BatchWorkload(**fields))  # type: ignore[arg-type]
    best = plan(MODEL, GPUS[:1], request).plans[0]
    assert best.batch is not None
    return best.batch


def test_a_small_job_fits_the_spare_capacity_and_needs_no_gpu() -> None:
    small = batch_of(lines=100_000)
    assert (small.spare_lines, small.spot_lines, small.spot_replicas) == (100_000, 0, 0)
    assert small.spot_cost_usd == small.on_demand_cost_usd == 0.0


def test_the_rest_goes_to_spot_cheaper_than_on_demand_with_its_preemptions() -> None:
    big = batch_of(lines=5_000_000)
    assert big.spare_lines + big.spot_lines == 5_000_000
    assert 0 < big.spot_share < 1
    assert big.spot_replicas >= big.on_demand_replicas >= 1
    rate = big.lines_per_s_per_replica * 24 * 3600
    assert big.on_demand_replicas == math.ceil(big.spot_lines / rate)
    assert big.expected_preemptions == pytest.approx(0.05 * big.spot_replicas * 24)
    assert big.spot_cost_usd < big.on_demand_cost_usd
    assert big.spot_price_per_gpu_hour_usd == pytest.approx(0.3 * 3.0)  # 70 % off $3.00


def test_preemptions_cost_replicas_and_a_shorter_window_needs_more() -> None:
    calm = batch_of(lines=5_000_000, preemptions_per_gpu_hour=0.0)
    assert calm.spot_replicas == calm.on_demand_replicas
    assert calm.savings == pytest.approx(0.7)
    # a replica down half of every hour: spot needs twice the replicas
    stormy = batch_of(lines=5_000_000, preemptions_per_gpu_hour=6.0, replace_s=300.0)
    assert stormy.spot_replicas >= 2 * calm.spot_replicas - 1
    assert stormy.expected_preemptions > calm.expected_preemptions == 0.0
    rushed = batch_of(lines=5_000_000, window_hours=6.0)
    assert rushed.spare_lines < calm.spare_lines
    assert rushed.spot_replicas > calm.spot_replicas


@settings(max_examples=40, deadline=None)
@given(
    lines=st.integers(1, 50_000_000),
    hours=st.floats(0.5, 72.0),
    target=st.floats(0.1, 1.0),
    rate=st.floats(0.0, 2.0),
)
def test_every_line_is_placed_once_and_spot_never_costs_more_per_line_left(
    lines: int, hours: float, target: float, rate: float
) -> None:
    b = batch_of(
        lines=lines, window_hours=hours, spare_target=target, preemptions_per_gpu_hour=rate
    )
    assert b.spare_lines + b.spot_lines == lines
    assert b.spare_lines >= 0
    assert b.spot_replicas >= b.on_demand_replicas
    assert (b.spot_replicas == 0) == (b.spot_lines == 0)


def test_the_cli_shows_the_batch_job_and_its_json() -> None:
    from typer.testing import CliRunner  # noqa: PLC0415

    from gpufleet.cli import app  # noqa: PLC0415

    runner = CliRunner()
    shown = runner.invoke(
        app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--rps", "20",
              "--batch-lines", "5000000", "--spot-discount", "0.6"],
    )  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert "batch job" in shown.output
    assert "on spare capacity" in shown.output
    assert "spot" in shown.output
    as_json = runner.invoke(
        app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--json",
              "--batch-lines", "5000000"],
    )  # fmt: skip
    assert '"spot_replicas"' in as_json.output
    bad = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--batch-lines", "0"])
    assert bad.exit_code == 2
    assert "--batch-lines" in bad.output
