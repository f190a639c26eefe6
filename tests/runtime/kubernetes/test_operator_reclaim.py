"""Nodes taken back, in operator mode: NO REAL CLUSTER RUNS HERE.

The fake API server (``fake_api.py``, real HTTP on loopback; the Kubernetes API server is the
only thing faked) serves EndpointSlices whose endpoints name their node, and the nodes; the
test taints and cordons them as a termination handler or ``kubectl`` would. The operator's
snapshots go, as under ``gpufleet up``, through ``RuntimeReplicas`` into the gateway's own
``LiveControl``, whose every event is recorded: the pool controller is what must hear the
notice, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpufleet.cli._up_cmd import RuntimeReplicas, reclaim_rules
from gpufleet.config import ReclaimConfig, parse_fleet
from gpufleet.fleet import ReplicaState
from gpufleet.gateway import GatewayMetrics, LiveControl
from gpufleet.runtime import EngineSpec, PoolSpec, RuntimeSnapshot
from gpufleet.runtime.kubernetes import (
    ApiConfig,
    KubeApi,
    KubernetesRuntime,
    OperatorSettings,
    cluster_pools,
)

from .fake_api import FakeKubeApi, serving
from .test_operator import eventually, until

NS = "gpufleet"
POOL = "llama-3.1-8b"
SVC = "llama-3-1-8b"
GKE = "cloud.google.com/impending-node-termination"
NOW = 1_750_000_000.0
"""The wall clock the operator and the gateway read (Unix seconds), moved by the test."""
RULES = reclaim_rules(ReclaimConfig(cordon=True))  # the fleet file's defaults, and cordons
FAST = OperatorSettings(
    resync_s=0.5, drain_timeout_s=5.0, probe_interval_s=0.01, retry_s=0.02, reclaim=RULES
)
FLEET = parse_fleet({"models": [{"name": POOL, "replicas": 2}], "runtime": "kubernetes"})

pytestmark = pytest.mark.asyncio


class Clocks:
    """The wall clock (Unix seconds) and the controller's monotonic one, both by hand."""

    def __init__(self) -> None:
        self.wall = NOW
        self.mono = 100.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


async def no_drain(pod: str, url: str) -> int:
    return 0


@asynccontextmanager
async def operator(
    url: str, clocks: Clocks, settings: OperatorSettings = FAST
) -> AsyncIterator[KubernetesRuntime]:
    async with (
        KubeApi(ApiConfig(url), timeout_s=2.0) as api,
        KubernetesRuntime(
            api,
            NS,
            cluster_pools([PoolSpec(POOL, EngineSpec(model=POOL), replicas=2)]),
            settings=settings,
            in_flight=no_drain,
            wall=lambda: clocks.wall,
        ) as runtime,
    ):
        yield runtime


def gateway_control(runtime: KubernetesRuntime, clocks: Clocks) -> tuple[LiveControl, io.StringIO]:
    """The gateway's controllers fed by the runtime, as ``gpufleet up`` wires them."""
    control = LiveControl(
        FLEET,
        GatewayMetrics(CollectorRegistry()),
        clock=lambda: clocks.mono,
        admission=False,
        wall=lambda: clocks.wall,
    )
    log = io.StringIO()
    control.record(log)
    RuntimeReplicas(runtime).subscribe(control.set_replicas)
    return control, log


def preemptions(log: io.StringIO) -> list[dict[str, Any]]:
    """The Preempting events the controller handled (the recording's lines)."""
    lines = [json.loads(line) for line in log.getvalue().splitlines()[1:]]
    return [line["event"] for line in lines if line["event"]["kind"] == "preempting"]


def rfc3339(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def states(control: LiveControl) -> dict[str, ReplicaState]:
    """The pool as its controller's view shows it."""
    return {v.id: v.state for v in control.pools[POOL].view.pools.get(POOL, ())}


def reclaim_at(snapshot: RuntimeSnapshot) -> dict[str, float | None]:
    return {r.name: r.reclaim_at for r in snapshot.replicas if r.url is not None}


async def seen_all(fake: FakeKubeApi, runtime: KubernetesRuntime) -> None:
    """The node watch has applied every change the fake made so far."""
    assert runtime.nodes is not None
    watch = runtime.nodes
    await eventually(lambda: watch.resource_version == str(fake.rv))


@pytest.fixture
def fake() -> FakeKubeApi:
    api = FakeKubeApi(NS)
    api.scales[SVC] = 2
    for node in ("node-1", "node-2"):
        api.set_node(node)
    api.set_pod(SVC, "pod-a", 8001, node="node-1")
    api.set_pod(SVC, "pod-b", 8001, ip="127.0.0.2", node="node-2")
    return api


async def test_a_tainted_node_s_pods_carry_its_deadline_and_the_others_none(
    fake: FakeKubeApi,
) -> None:
    clocks = Clocks()
    async with serving(fake) as url, operator(url, clocks) as runtime:
        await until(runtime, lambda s: reclaim_at(s) == {"pod-a": None, "pod-b": None})
        fake.taint_node("node-1", GKE)
        await until(runtime, lambda s: reclaim_at(s) == {"pod-a": NOW + 30, "pod-b": None})

        # seen again later (another taint on it, unrelated): the deadline does not move
        clocks.advance(5.0)
        fake.taint_node("node-1", "nvidia.com/gpu")
        await seen_all(fake, runtime)
        assert reclaim_at(runtime.snapshot) == {"pod-a": NOW + 30, "pod-b": None}
        # a pod that starts on that node meanwhile gets the same deadline
        fake.set_pod(SVC, "pod-c", 8001, ip="127.0.0.3", ready=False, node="node-1")
        snapshot = await until(runtime, lambda s: "pod-c" in reclaim_at(s))
        assert reclaim_at(snapshot)["pod-c"] == NOW + 30

        # the taint is gone (a handler that changed its mind): no deadline is published
        fake.set_node("node-1")
        await until(runtime, lambda s: set(reclaim_at(s).values()) == {None})
        # a cordon, with timeAdded-less notice from when it is seen
        fake.cordon_node("node-2")
        await until(runtime, lambda s: reclaim_at(s)["pod-b"] == clocks.wall + 30)
        fake.cordon_node("node-2", cordoned=False)
        await until(runtime, lambda s: reclaim_at(s)["pod-b"] is None)

    nodes = fake.calls_to("GET", "/api/v1/nodes")
    lists = [c for c in nodes if "watch" not in c.query]
    watches = [c for c in nodes if c.query.get("watch") == "1"]
    assert len(lists) == 1  # watched, not polled
    assert len(watches) == 1
    assert watches[0].query["allowWatchBookmarks"] == "true"
    assert "labelSelector" not in watches[0].query  # every node: a pod may land on any
    assert "resourceVersion" in watches[0].query  # from the list's


async def test_the_gateway_s_controller_hears_one_notice_and_stops_routing_to_that_pod(
    fake: FakeKubeApi,
) -> None:
    clocks = Clocks()
    async with serving(fake) as url, operator(url, clocks) as runtime:
        control, log = gateway_control(runtime, clocks)
        pool = control.pools[POOL]

        def routable() -> set[str]:
            return {r.id for r in pool.routable()}

        await eventually(lambda: routable() == {"pod-a", "pod-b"})
        added = NOW - 10.0  # the handler tainted it 10 s before we saw it: 20 s are left
        fake.taint_node("node-1", GKE, time_added=rfc3339(added))
        await eventually(lambda: routable() == {"pod-b"})
        (notice,) = preemptions(log)
        assert (notice["model"], notice["replica"]) == (POOL, "pod-a")
        assert notice["at"] == pytest.approx(clocks.mono + 20.0)  # on the controller's clock
        assert states(control)["pod-a"] is ReplicaState.DRAINING  # the autoscaler's view too

        # the same notice seen again (the node modified, a relist after 410 Gone, a pod of
        # the pool changing): the controller hears nothing more
        fake.taint_node("node-1", "nvidia.com/gpu")
        fake.compact()
        fake.set_pod(SVC, "pod-b", 8001, ip="127.0.0.2", node="node-2")  # a new slice version
        await seen_all(fake, runtime)
        assert runtime.nodes is not None
        assert runtime.nodes.lists == 2
        await asyncio.sleep(0.05)
        assert len(preemptions(log)) == 1
        assert routable() == {"pod-b"}

        # a sooner deadline (the node is out of service: down already) is handed on
        fake.taint_node("node-1", "node.kubernetes.io/out-of-service", "nodeshutdown")
        await eventually(lambda: len(preemptions(log)) == 2)
        assert preemptions(log)[1]["at"] == pytest.approx(clocks.mono)
        assert routable() == {"pod-b"}  # the other pod serves on, never noticed
        assert {p["replica"] for p in preemptions(log)} == {"pod-a"}

        # Kubernetes then terminates the pod, as today: draining, then gone
        fake.set_pod(SVC, "pod-a", 8001, ready=False, terminating=True, node="node-1")
        await eventually(lambda: states(control)["pod-a"] is ReplicaState.DRAINING)
        fake.remove_pod(SVC, "pod-a")
        await eventually(lambda: "pod-a" not in states(control))
        assert states(control)["pod-b"] is ReplicaState.READY
        events = [e["text"] for e in control.timeline.after()]
        assert sum("preemption notice" in text for text in events) == 2


async def test_an_on_demand_pool_s_pod_on_a_drained_node_is_noticed_too(
    fake: FakeKubeApi,
) -> None:
    """Any pool: a node drain (a cordon, then evictions) takes on-demand pods as well."""
    assert FLEET.models[0].capacity.value == "on_demand"
    clocks = Clocks()
    async with serving(fake) as url, operator(url, clocks) as runtime:
        control, log = gateway_control(runtime, clocks)
        await eventually(lambda: len(control.pools[POOL].routable()) == 2)
        fake.cordon_node("node-2")  # kubectl drain node-2
        await eventually(lambda: [p["replica"] for p in preemptions(log)] == ["pod-b"])
        assert preemptions(log)[0]["at"] == pytest.approx(clocks.mono + 30.0)


async def test_without_reclaim_rules_no_node_is_watched(fake: FakeKubeApi) -> None:
    clocks = Clocks()
    settings = dataclasses.replace(FAST, reclaim=None)
    async with serving(fake) as url, operator(url, clocks, settings) as runtime:
        fake.taint_node("node-1", GKE)
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        await asyncio.sleep(0.1)
        assert runtime.nodes is None
        assert set(reclaim_at(runtime.snapshot).values()) == {None}
    assert fake.calls_to("GET", "/api/v1/nodes") == []


@pytest.mark.parametrize("status", [403, 500])
async def test_a_node_watch_that_fails_is_retried_and_the_pods_serve_meanwhile(
    fake: FakeKubeApi, status: int
) -> None:
    """403: manifests rendered before the ClusterRole; 500: the API server's trouble."""
    fake.fail("GET", "/api/v1/nodes", status, times=3)
    clocks = Clocks()
    async with serving(fake) as url, operator(url, clocks) as runtime:
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        assert runtime.nodes is not None
        nodes = runtime.nodes
        await eventually(nodes.synced.is_set)  # after three refusals
        fake.taint_node("node-2", "karpenter.sh/disrupted")
        await until(runtime, lambda s: reclaim_at(s)["pod-b"] == NOW + 30)
    assert len(fake.calls_to("GET", "/api/v1/nodes")) >= 5  # 3 refused, a list, a watch
