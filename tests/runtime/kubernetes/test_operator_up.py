"""``gpufleet up --runtime kubernetes`` end to end: NO REAL CLUSTER RUNS HERE.

The fake API server (``fake_api.py``) plays the cluster and one real sim engine, served on
loopback, plays the pool's one pod; ``gpufleet up`` runs as a subprocess, finds the pod
through the EndpointSlice watch and routes a chat completion to it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from .cluster import sim_pod
from .fake_api import FakeKubeApi, serving

pytestmark = pytest.mark.asyncio


async def test_up_in_operator_mode_routes_to_the_pods_the_cluster_reports(
    tmp_path: Path,
) -> None:
    fake = FakeKubeApi("inference")
    fake.scales["llama-3-1-8b"] = 1
    async with serving(fake) as api, sim_pod() as port:
        fake.set_pod("llama-3-1-8b", "llama-3-1-8b-abc12", port)
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(
            "models: [{name: llama-3.1-8b, replicas: 1}]\n"
            f"runtime: {{namespace: inference, api_server: '{api}'}}\n"
        )
        up = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--port", "0"),
            *("--runtime", "kubernetes"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "GPUFLEET_HOME": str(tmp_path / "home")},  # its batch store
        )
        assert up.stdout is not None
        out = ""
        try:
            async with asyncio.timeout(30):
                while "listening on" not in out:
                    line = (await up.stdout.readline()).decode()
                    assert line, out
                    out += line
            assert "operator mode" in out
            assert "llama-3-1-8b-abc12" in out
            base = out.split("listening on ")[1].split()[0]
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                async with asyncio.timeout(10):  # routable after its first health probe
                    while (await client.get("/ready")).status_code != 200:
                        await asyncio.sleep(0.05)
                reply = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "llama-3.1-8b",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4,
                    },
                )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
        finally:
            up.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                rest = (await up.stdout.read()).decode()
                code = await up.wait()
    assert code == 0, out + rest
    assert "stopped" in rest
    assert fake.calls_to("GET", "/namespaces/inference/endpointslices")
