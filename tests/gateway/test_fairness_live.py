"""Fairness live, with real keys over HTTP: a heavy tenant sending 10× a light one's load into a
saturated pool queues at the gateway, and the light tenant's TTFT P99 stays within 2× of what
it gets alone (the issue's bar), thanks to the fair-share reserve.

Two sim replicas (child processes) of 16 slots, queueing from saturation 0.5 (16 running),
the reserve up to 1.0. The heavy tenant (30 req/s of 120-token answers) needs more than the
16 gated slots serve, so it queues; the light one (3 req/s) asks far less than its half
share of what runs, so it starts at once in the reserve. ``bench/fairness.py --live`` runs it
longer, with the contrasts (no reserve, FIFO); docs/tenants.md ("Fairness") has the numbers.
"""

from __future__ import annotations

from pathlib import Path

from tests.gateway.fairness_live import run_live

JITTER_MS = 30.0
"""Slack on the bar. The P99 of ~16 light requests is their slowest, and a 2-core machine
shared with other jobs stalls a process for tens of ms at times. The clients run in their own
processes (one per tenant), so parsing the heavy tenant's streams no longer stalls the light
tenant's clock: runs measure 18-24 ms beside the heavy tenant against 17-18 ms alone, two CPU
hogs beside them included (in one shared interpreter CI once measured 74.7 ms against 17.4).
The policy's part, that no light request waits for a slot, is asserted exactly below."""


def test_a_light_tenant_beside_a_10x_heavy_one_keeps_its_ttft(tmp_path: Path) -> None:
    result = run_live(tmp_path, light_rate=3.0, duration=6.0, tokens=120)
    light, heavy, alone = (
        result["light_with_heavy"],
        result["heavy_with_light"],
        result["light_alone"],
    )
    gate = result["gate"]["with_heavy"]
    assert light["statuses"] == {200: light["served"]}  # nothing shed or failed
    assert alone["statuses"] == {200: alone["served"]}
    assert heavy["served"] > 5 * light["served"]
    # The heavy tenant saturates the pool: it queues at the gateway and waits there.
    assert gate["queue_max"] > 20
    assert heavy["ttft_ms"]["p50"] > 10 * light["ttft_ms"]["p50"]
    # The light tenant never waits for a slot: it starts in the reserve at once (the pool
    # controller's own decisions, recorded; its wait in the ledger also holds the body read,
    # auth and quota, which a loaded 2-core machine stretches past 10 ms at times).
    assert gate["light_queued"] == 0
    assert gate["light_queue_ms_max"] < 50
    # The bar: light TTFT P99 beside the heavy tenant within 2× of alone (+ jitter slack).
    assert light["ttft_ms"]["p99"] <= 2 * alone["ttft_ms"]["p99"] + JITTER_MS, result
