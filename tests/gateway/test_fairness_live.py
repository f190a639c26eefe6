"""Fairness live, with real keys over HTTP: a heavy tenant sending 10× a light one's load into a
saturated pool is queued (and waits), the light one is not shed and waits far less.

The issue's bar (light TTFT P99 within 2× of alone) is measured by ``bench/fairness.py``; it
is not asserted here: in a one-replica pool a light request that arrives while the pool is
full must wait for a running request to end (~100 ms here against ~10 ms alone), however
fair the order. docs/tenants.md ("Fairness") has the numbers.
"""

from __future__ import annotations

from pathlib import Path

from tests.gateway.fairness_live import run_live


def test_a_heavy_tenant_queues_and_the_light_one_is_served_first(tmp_path: Path) -> None:
    result = run_live(tmp_path, light_rate=2.0, duration=5.0, tokens=120)
    light, heavy = result["light_with_heavy"], result["heavy_with_light"]
    assert light["statuses"] == {200: light["served"]}  # nothing shed or failed
    assert result["light_alone"]["statuses"] == {200: result["light_alone"]["served"]}
    assert heavy["served"] > 5 * light["served"]
    # The heavy tenant's backlog waits at the gateway; fair share lets the light one through.
    assert light["ttft_ms"]["p50"] * 2 < heavy["ttft_ms"]["p50"]
