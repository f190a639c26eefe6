"""``engine: external`` under ``gpufleet up``: endpoints someone else runs are probed, routed
and retried like started replicas, and never started or stopped.

The "someone else" is a sim replica this test serves in a thread, and a loopback port nothing
listens on (a dead endpoint).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import openai

from tests.gateway.conftest import MODEL, closed_port_url, sim_replica
from tests.up_process import start_up, stop, wait_ready


def _metric(base: str, name: str, **labels: str) -> float | None:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_external_endpoints_are_probed_routed_and_left_running(tmp_path: Path) -> None:
    dead = closed_port_url()
    with sim_replica() as live:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(
            f"models:\n"
            f"  - name: {MODEL}\n"
            f"    engine: external\n"
            f'    endpoints: ["{dead}", "{live}/"]\n'
            f"    startup: {{timeout: 1}}\n"
            f"    health: {{active: {{interval: 0.2}}}}\n"
        )
        log = tmp_path / "up.out"
        process, base = start_up(fleet, log, run_dir=tmp_path / "run")
        try:
            text = log.read_text()
            assert re.search(rf"replica {MODEL}-1\s+ready\s+{live}\s", text), text
            assert re.search(rf"replica {MODEL}-0\s+(starting|failed)\s", text), text
            wait_ready(base)
            with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
                for i in range(5):
                    reply = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2
                    )
                    assert reply.choices[0].message.content
            replica = f"{MODEL}-1"
            assert _metric(base, "gpufleet:gateway_upstream_attempts_total", replica=replica) == 5
            assert (
                _metric(base, "gpufleet:gateway_upstream_attempts_total", replica=f"{MODEL}-0")
                is None
            )
            # the dead endpoint is probed again and again (its "restarts"), never routed
            deadline = time.monotonic() + 20
            while (
                _metric(base, "gpufleet:runtime_replica_crashes_total", reason="start_timeout") or 0
            ) < 2:
                assert time.monotonic() < deadline, httpx.get(base + "/metrics").text
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, log.read_text()
        finally:
            stop(process)
        # nothing here stopped the endpoint someone else runs
        assert httpx.get(live + "/health").status_code == 200
