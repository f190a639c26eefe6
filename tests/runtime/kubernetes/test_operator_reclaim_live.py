"""A node taken back under 16 clients, in operator mode: NO REAL CLUSTER RUNS HERE.

``gpufleet up --runtime kubernetes`` runs as a subprocess against the fake API server (the only
thing faked: ``fake_api.py``, real HTTP on loopback); three real sim engine processes are the
pool's pods, each on its own loopback address and node. The official ``openai`` client in 16
threads makes the load (streams and whole answers, each in a loop, as in
``tests/gateway/test_preempt_live.py``). The test plays the cloud: it taints the first pod's
node with GKE's termination taint, kills that pod's process at the notice's deadline (the VM
is gone), and starts a replacement pod on another node, as the ReplicaSet would.

The gateway hears the taint through its node watch; its controller stops routing to the pod
and moves what was there at once (``spot.abandon_before`` is the whole notice). No request
fails, no answer is cut short, the pod gets no new work from the notice on, the other pod
serves throughout and the replacement serves after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.test_hang_live import Client, loop

from .cluster import gateway_up
from .fake_api import FakeKubeApi, serving
from .test_operator_autoscale import running as in_flight

pytestmark = pytest.mark.asyncio

NS = "inference"
MODEL = "llama-3.1-8b"  # the model tests.gateway.test_hang_live's clients ask for
SVC = "llama-3-1-8b"
GKE = "cloud.google.com/impending-node-termination"
CLIENTS = 16
NOTICE_S = 3.0
"""The taint's notice: long enough to see that nothing new goes to the pod meanwhile."""
ENGINE = ("--time-scale", "1", "--max-model-len", "4096")


def fleet_yaml(api: str) -> str:
    fleet = {
        "models": [
            {
                "name": MODEL,
                "replicas": 2,
                "routing": "least_request",
                "capacity": "spot",
                "spot": {"abandon_before": NOTICE_S},  # the notice's whole lead: move at once
                "health": {"active": {"interval": 0.2}},
            }
        ],
        "runtime": {
            "namespace": NS,
            "api_server": api,
            "resync_s": 0.5,
            "reclaim": {"notice_s": NOTICE_S},  # the default taints, this notice
        },
    }
    return json.dumps(fleet)  # JSON is YAML


@contextlib.contextmanager
def sim_engine(ip: str, port: int) -> Iterator[subprocess.Popen[str]]:
    """A sim engine process on ``ip:port`` (a pod: the pods of one slice share a port)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpufleet", "engine", "sim", "--host", ip, "--port", str(port),
         *ENGINE],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://{ip}:{port}/health", timeout=1).status_code == 200:
                    break
            assert process.poll() is None, "the sim engine exited"
            assert time.monotonic() < deadline, "the sim engine did not start"
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.communicate()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


async def metric(base: str, name: str, **labels: str) -> float:
    """The sum of a gateway counter's samples that carry ``labels``."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


async def test_a_tainted_node_s_pod_under_16_clients_loses_no_request(tmp_path: Path) -> None:
    fake = FakeKubeApi(NS)
    fake.scales[SVC] = 2
    port = free_port()
    ips = {"pod-0": "127.0.0.10", "pod-1": "127.0.0.11", "pod-2": "127.0.0.12"}
    for i in range(3):
        fake.set_node(f"node-{i}")
    with sim_engine(ips["pod-0"], port) as victim, sim_engine(ips["pod-1"], port):
        async with serving(fake) as api:
            for i, pod in enumerate(("pod-0", "pod-1")):
                fake.set_pod(SVC, pod, port, ip=ips[pod], node=f"node-{i}")
            fleet = tmp_path / "fleet.yaml"
            fleet.write_text(fleet_yaml(api))
            async with gateway_up(fleet) as gateway:
                out = gateway.out
                async with httpx.AsyncClient(base_url=gateway.base) as http:
                    async with asyncio.timeout(10):
                        while (await http.get("/ready")).status_code != 200:
                            await asyncio.sleep(0.05)
                clients = [Client(stream=i % 2 == 0) for i in range(CLIENTS)]
                until = time.monotonic() + 11.0
                with openai.OpenAI(
                    base_url=f"{gateway.base}/v1", api_key="none", max_retries=0, timeout=60
                ) as client:
                    threads = [
                        threading.Thread(target=loop, args=(client, c, i, until))
                        for i, c in enumerate(clients)
                    ]
                    for t in threads:
                        t.start()
                    try:
                        await asyncio.sleep(2.0)
                        busy = await in_flight(ips["pod-0"], port)
                        assert busy > 0  # both pods serve before the notice
                        assert await in_flight(ips["pod-1"], port) > 0
                        done_before = sum(len(c.took) for c in clients)

                        # -- the cloud: a termination taint on pod-0's node
                        tainted = time.monotonic()
                        fake.taint_node("node-0", GKE)
                        abandoned = 0.0

                        async def moved() -> float:
                            return await metric(
                                gateway.base, "gpufleet:gateway_abandoned_attempts_total"
                            )

                        async with asyncio.timeout(5):
                            while (abandoned := await moved()) == 0:
                                await asyncio.sleep(0.02)
                        heard = time.monotonic() - tainted
                        # what was there moved at once; nothing new arrives until the deadline
                        async with asyncio.timeout(2):
                            while await in_flight(ips["pod-0"], port):
                                await asyncio.sleep(0.02)
                        idle_from = time.monotonic()
                        samples = []
                        while time.monotonic() < tainted + NOTICE_S:
                            samples.append(await in_flight(ips["pod-0"], port))
                            await asyncio.sleep(0.05)
                        assert samples, "the notice was over before pod-0 was idle"
                        assert set(samples) == {0}, samples
                        idle_for = time.monotonic() - idle_from

                        # -- the deadline: the VM is gone; the ReplicaSet replaces the pod
                        victim.send_signal(signal.SIGKILL)
                        fake.remove_pod(SVC, "pod-0", port)
                        with sim_engine(ips["pod-2"], port):
                            fake.set_pod(SVC, "pod-2", port, ip=ips["pod-2"], node="node-2")
                            async with asyncio.timeout(10):
                                while not await in_flight(ips["pod-2"], port):
                                    await asyncio.sleep(0.05)  # the gateway routes to it
                            await asyncio.to_thread(lambda: [t.join() for t in threads])
                    finally:
                        await asyncio.to_thread(lambda: [t.join() for t in threads])
    assert gateway.code == 0, "".join(out)
    errors = [e for c in clients for e in c.errors]
    assert not errors, errors[:3]
    done = sum(len(c.took) for c in clients)
    assert done > done_before + CLIENTS, (done_before, done)  # the other pods served on
    # every answer whole: 128 tokens a stream, 32 a chat (tests.gateway.test_hang_live)
    assert all(n == (128 if c.stream else 32) for c in clients for n in c.tokens)
    assert any("node-0 is being taken back" in line for line in out), "".join(out)[-4000:]
    print(
        f"\n{done} requests, 0 failed; the taint reached the controller in {heard:.2f} s and "
        f"moved {abandoned:g} attempt(s) at once ({busy} were on the pod); the pod then took "
        f"no new work for {idle_for:.2f} s until its deadline; the replacement served"
    )
