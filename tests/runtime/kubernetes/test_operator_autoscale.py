"""Operator mode + the live autoscaler, end to end: NO REAL CLUSTER RUNS HERE.

``gpufleet up --runtime kubernetes`` runs as a subprocess against the fake API server; real
sim engines on loopback are the pool's pods, and the test plays the ReplicaSet: when the
gateway patches the Deployment's scale up, it starts a pod and reports it ready in the
EndpointSlice; when the gateway patches it down, it deletes the pod that carries the
pod-deletion cost (as a ReplicaSet does). The official ``openai`` client makes the load.

Windows and cooldowns are seconds, and each engine holds 2 sequences, so ten concurrent
streams overload the pool's two pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import openai
import pytest

from gpufleet.engine.server import SimEngineConfig
from gpufleet.runtime.kubernetes import DELETION_COST, DELETION_COST_ANNOTATION, GATEWAY

from .cluster import gateway_up, sim_pod
from .fake_api import FakeKubeApi, serving

pytestmark = pytest.mark.asyncio

NS = "inference"
MODEL = "llama-3.1-8b"
SVC = "llama-3-1-8b"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{SVC}/scale"
SEQS = 2
LONG = 1900
"""Tokens of a stream that outlasts the scale-down (about 10 s at time scale 1)."""
ENGINE = SimEngineConfig(time_scale=1.0, max_num_seqs=SEQS, max_model_len=2048)


def fleet_yaml(api: str) -> str:
    autoscale = {
        "min_replicas": 2,
        "max_replicas": 3,
        "stable_window": 2,
        "panic_window": 1,
        "scale_down_cooldown": 1,
        "forecast": {"enabled": False},
    }
    fleet = {
        "gateway": {"autoscaler": {"interval": 0.25}},
        "models": [
            {
                "name": MODEL,
                "replicas": 2,
                "args": ["--max-num-seqs", str(SEQS)],  # what saturation is judged by
                "routing": "least_request",
                "health": {"active": {"interval": 0.2}},
                "autoscale": autoscale,
            }
        ],
        "runtime": {"namespace": NS, "api_server": api, "resync_s": 0.5, "drain_timeout_s": 20},
    }
    return json.dumps(fleet)  # JSON is YAML


class Streams:
    """Closed-loop streaming clients; failures recorded (a cancelled client is not one)."""

    def __init__(self, base: str) -> None:
        self.client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        self.done = 0
        self.failures: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    def add(self, clients: int, tokens: int = 40) -> list[asyncio.Task[None]]:
        new = [asyncio.create_task(self._loop(tokens)) for _ in range(clients)]
        self.tasks += new
        return new

    async def stop(self, tasks: list[asyncio.Task[None]] | None = None) -> None:
        for task in tasks if tasks is not None else self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if tasks is None:
            await self.client.close()

    async def _loop(self, tokens: int) -> None:
        while True:
            try:
                stream = await self.client.completions.create(
                    model=MODEL,
                    prompt="tell me a story",
                    max_tokens=tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finish = None
                async for chunk in stream:
                    finish = chunk.choices[0].finish_reason or finish
                if finish != "length":
                    self.failures.append(f"stream ended with {finish!r}")
                self.done += 1
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.failures.append(f"{type(error).__name__}: {error}")


async def running(ip: str, port: int) -> int:
    """Requests running or waiting in the sim engine at ``ip:port`` (its own /metrics)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{ip}:{port}/metrics")).text
    return sum(
        int(float(line.split()[-1]))
        for line in text.splitlines()
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
    )


async def eventually(check: Callable[[], bool], timeout: float, what: str, out: list[str]) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}\n{''.join(out)[-4000:]}") from None


async def test_the_autoscaler_patches_the_scale_up_then_drains_and_removes_the_idlest_pod(
    tmp_path: Path,
) -> None:
    fake = FakeKubeApi(NS)
    fake.scales[SVC] = 2
    pods: dict[str, str] = {}  # pod name -> the loopback IP of the sim engine playing it
    async with serving(fake) as api, AsyncExitStack() as cluster:
        port = await cluster.enter_async_context(sim_pod(ENGINE, "127.0.0.10"))

        async def start_pod(name: str) -> None:  # one IP per pod, one port for all (a slice)
            ip = f"127.0.0.{10 + len(pods)}"
            if pods:
                await cluster.enter_async_context(sim_pod(ENGINE, ip, port))
            pods[name] = ip
            fake.set_pod(SVC, name, port, ip=ip)

        for name in ("pod-0", "pod-1"):
            await start_pod(name)
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(fleet_yaml(api))
        async with gateway_up(fleet) as gateway:
            out = gateway.out
            load = Streams(gateway.base)
            try:
                # -- overload the two pods: the autoscaler asks the Deployment for three
                started = time.monotonic()
                crowd = load.add(10)
                await eventually(lambda: fake.scales[SVC] == 3, 20, "scale-up patch", out)
                up_after = time.monotonic() - started
                (up,) = fake.calls_to("PATCH", "/scale")
                assert (up.path, up.body) == (SCALE_PATH, {"spec": {"replicas": 3}})
                assert up.content_type == "application/merge-patch+json"
                # the ReplicaSet starts a pod; its endpoint becomes ready; the gateway uses it
                await start_pod("pod-2")
                await eventually(lambda: load.done >= 20, 20, "requests served", out)
                async with asyncio.timeout(10):
                    while "pod-2" not in await _routed_to(gateway.base):
                        await asyncio.sleep(0.05)

                # -- the crowd leaves; two long streams stay, on one or two of the three pods
                await load.stop(crowd)
                stayers = load.add(2, tokens=LONG)
                counts: dict[str, int] = {}
                async with asyncio.timeout(10):
                    while sum(counts.values()) != 2:
                        counts = {name: await running(ip, port) for name, ip in pods.items()}
                        await asyncio.sleep(0.05)
                idle = {name for name, count in counts.items() if count == 0}
                busy = sorted(name for name, count in counts.items() if count > 0)
                down_from = time.monotonic()
                await eventually(lambda: fake.scales[SVC] == 2, 30, "scale-down patch", out)
                down_after = time.monotonic() - down_from
                assert not any(task.done() for task in stayers)  # never cut
            finally:
                await load.stop()
            stopping = time.monotonic()
            # the ReplicaSet deletes the pod with the lowest deletion cost
            marked = [p for p, a in fake.pod_annotations.items() if DELETION_COST_ANNOTATION in a]
            assert len(marked) == 1
            victim = marked[0]
            assert victim in idle, (victim, counts)  # never a pod that serves a stream
            assert fake.pod_annotations[victim] == {DELETION_COST_ANNOTATION: DELETION_COST}
            fake.remove_pod(SVC, victim)

    stopped_in = time.monotonic() - stopping
    assert gateway.code == 0, "".join(out)
    patches = [(c.path, c.body) for c in fake.calls if c.method == "PATCH"]
    assert patches == [
        (SCALE_PATH, {"spec": {"replicas": 3}}),
        (
            f"/api/v1/namespaces/{NS}/pods/{victim}",
            {"metadata": {"annotations": {DELETION_COST_ANNOTATION: DELETION_COST}}},
        ),
        (SCALE_PATH, {"spec": {"replicas": 2}}),
    ]
    assert load.failures == []
    decisions = [
        json.loads(line.split("autoscale ", 1)[1]) for line in out if '"direction"' in line
    ]
    downs = [d for d in decisions if d["direction"] == "down"]
    assert downs[0]["drain"] == [victim]  # the least loaded, by the gateway's own count
    # the single gateway held the Lease all along (leader election is on with autoscaling)
    assert fake.holder(GATEWAY) is None  # released on SIGTERM
    assert any("leader election" in line for line in out)
    print(
        f"\nscale-up patch {up_after:.2f} s after 10 streams hit 2 pods x {SEQS} seqs; "
        f"scale-down patch {down_after:.2f} s after the crowd left (drained {victim}, kept "
        f"{', '.join(busy)}); {load.done} requests, 0 failed; "
        f"gateway stopped in {stopped_in:.2f} s"
    )


async def _routed_to(base: str) -> set[str]:
    """Replicas the gateway sent attempts to (its own counter)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base}/metrics")).text
    routed = set()
    for line in text.splitlines():
        if line.startswith("gpufleet:gateway_upstream_attempts_total{"):
            with contextlib.suppress(IndexError):
                if float(line.split()[-1]) > 0:
                    routed.add(line.split('replica="')[1].split('"')[0])
    return routed
