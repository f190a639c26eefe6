"""The spare-capacity gate under load, live: interactive clients stream beside a batch
through the real gateway over sim engine processes. The mechanism, not the bench's ratios
(``bench/batch_spare_capacity.py``): every interactive request is served, the batch makes
progress while they run, and the gate holds batch lines back instead of filling the pool."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.batch_spare_live import run_spare


def test_interactive_is_served_and_the_batch_progresses_beside_it(tmp_path: Path) -> None:
    result = run_spare(
        tmp_path,
        duration=6.0,
        lines=400,
        capacity_s=3.0,
        ramp=1.5,
        time_scale=0.5,
        spares=({"target": 0.75},),
    )
    slots = result["slots"]
    (run,) = result["with_batch"]
    alone, with_batch = result["interactive_alone"][0], run["interactive"]
    # interactive not starved: every request answered, alone and beside the batch
    assert alone["served"] > 20
    assert with_batch["statuses"] == {200: with_batch["served"]}
    assert with_batch["served"] == alone["served"]  # the same plan, all of it
    # the batch progresses while interactive runs
    assert run["batch_lines_in_window"] > 0
    # the gate held lines back (the runner offered twice the slots) and never let batch
    # lines past its target share of the slots
    assert run["gated"] > run["batch_in_flight_max"]
    assert 0 < run["batch_in_flight_max"] <= 0.75 * slots
    # without the gate, the same offer fills every slot (the capacity phase): the contrast
    assert result["capacity_rps"] > run["batch_rps"]
