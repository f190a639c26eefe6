"""Operator mode against an emulated Kubernetes API server: NO REAL CLUSTER RUNS HERE.

``fake_api.FakeKubeApi`` is a small fake of the API server (EndpointSlice list and watch with
resource versions and 410 Gone, ``deployments/scale``, pod patches) served over real HTTP on
loopback; the operator talks to it with its real httpx client. What a real cluster adds (the
EndpointSlice controller, the ReplicaSet honouring the deletion cost, RBAC enforcement) is
played by the test: it moves pods itself, and checks every call against the rendered Role.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest

from gpufleet.cli._up_cmd import reclaim_rules
from gpufleet.config import ReclaimConfig
from gpufleet.fleet import ReplicaLoad, ReplicaState, ReplicaView
from gpufleet.policy import AutoscaleConfig, AutoscalePolicy, PoolView, ScaleDirection
from gpufleet.runtime import (
    EngineKind,
    EngineSpec,
    Phase,
    PoolSpec,
    ReplicaStatus,
    RuntimeSnapshot,
)
from gpufleet.runtime.kubernetes import (
    DELETION_COST,
    DELETION_COST_ANNOTATION,
    GATEWAY,
    ApiConfig,
    ClusterFleet,
    KubeApi,
    KubernetesRuntime,
    LeaderElection,
    LeaseSettings,
    OperatorSettings,
    cluster_pools,
    cluster_role_name,
    render,
)

from .fake_api import FakeKubeApi, serving

NS = "gpufleet"
POOL = "llama-3.1-8b"
SVC = "llama-3-1-8b"  # the pool's Service and Deployment name
SCALE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{SVC}/scale"
FAST = OperatorSettings(resync_s=0.5, drain_timeout_s=5.0, probe_interval_s=0.01, retry_s=0.02)
POOLS = (
    PoolSpec(POOL, EngineSpec(model=POOL), replicas=2),
    PoolSpec("partner", EngineSpec(kind=EngineKind.EXTERNAL, endpoints=("http://10.0.0.5:8000",))),
)

pytestmark = pytest.mark.asyncio


class Busy:
    """In-flight requests per pod, as the drain sees them (the test plays the engine)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.reads: list[str] = []

    async def __call__(self, pod: str, url: str) -> int | None:
        self.reads.append(pod)
        return self.count.get(pod, 0)


LEASE = LeaseSettings(lease_duration_s=3.0, renew_deadline_s=2.0, retry_period_s=0.05)


@asynccontextmanager
async def operator(
    fake: FakeKubeApi,
    url: str,
    busy: Busy | None = None,
    settings: OperatorSettings = FAST,
    *,
    identity: str | None = None,
    lease: LeaseSettings = LEASE,
) -> AsyncIterator[KubernetesRuntime]:
    """An operator; with an ``identity``, one of several gateway replicas (leader election)."""
    async with KubeApi(ApiConfig(url), timeout_s=2.0) as api:
        leader = None if identity is None else LeaderElection(api, NS, identity, lease)
        async with KubernetesRuntime(
            api,
            NS,
            cluster_pools(POOLS),
            settings=settings,
            in_flight=busy or Busy(),
            leader=leader,
        ) as runtime:
            yield runtime


async def until(
    runtime: KubernetesRuntime, predicate: Callable[[RuntimeSnapshot], bool]
) -> RuntimeSnapshot:
    async with asyncio.timeout(5):
        return await runtime.wait_for(predicate)


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def states(snapshot: RuntimeSnapshot) -> dict[str, ReplicaState]:
    """The pool's pods (an EndpointSlice lists them: they have a URL)."""
    return {r.name: r.state for r in snapshot.replicas if r.pool == POOL and r.url is not None}


def fleet(**pods: ReplicaState) -> Callable[[RuntimeSnapshot], bool]:
    return lambda snapshot: states(snapshot) == pods


@pytest.fixture
def fake() -> FakeKubeApi:
    api = FakeKubeApi(NS)
    api.scales[SVC] = 2
    return api


async def test_pods_appear_get_ready_and_disappear_through_one_watch(fake: FakeKubeApi) -> None:
    fake.set_pod(SVC, "pod-a", 8001)
    async with serving(fake) as url, operator(fake, url) as runtime:
        first = await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        (a,) = first.ready(POOL)
        assert (a.url, a.model) == ("http://127.0.0.1:8001", POOL)
        assert [r.url for r in first.ready("partner")] == ["http://10.0.0.5:8000"]

        fake.set_pod(SVC, "pod-b", 8001, ready=False)  # loading its model
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.STARTING}))
        fake.set_pod(SVC, "pod-b", 8001)
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.READY}))
        fake.set_pod(SVC, "pod-a", 8001, ready=False, terminating=True)  # being deleted
        await until(runtime, fleet(**{"pod-a": ReplicaState.DRAINING, "pod-b": ReplicaState.READY}))
        fake.remove_pod(SVC, "pod-a")
        await until(runtime, fleet(**{"pod-b": ReplicaState.READY}))
        fake.delete_service(SVC)
        await until(runtime, fleet())

    slices = "/endpointslices"
    lists = [c for c in fake.calls_to("GET", slices) if "watch" not in c.query]
    watches = [c for c in fake.calls_to("GET", slices) if c.query.get("watch") == "1"]
    assert len(lists) == 1  # watched, not polled
    assert len(watches) == 1
    assert watches[0].query["allowWatchBookmarks"] == "true"
    assert watches[0].query["resourceVersion"] == "101"  # the list's version
    assert watches[0].query["labelSelector"] == f"kubernetes.io/service-name in ({SVC})"


async def test_scale_up_patches_the_deployment_scale(fake: FakeKubeApi) -> None:
    async with serving(fake) as url, operator(fake, url) as runtime:
        runtime.scale(POOL, 4)
        await eventually(lambda: fake.scales[SVC] == 4)
        (patch,) = fake.calls_to("PATCH", "/scale")
        assert patch.path == SCALE_PATH
        assert patch.body == {"spec": {"replicas": 4}}
        assert patch.content_type == "application/merge-patch+json"
        await until(runtime, lambda s: s.desired[POOL] == 4)
        runtime.scale(POOL, 4)  # idempotent: nothing more to do
        await asyncio.sleep(0.1)
        assert len(fake.calls_to("PATCH", "/scale")) == 1


def unseen(snapshot: RuntimeSnapshot) -> list[ReplicaStatus]:
    """The pods the Deployment wants that no slice lists yet (published without a URL)."""
    return [r for r in snapshot.replicas if r.pool == POOL and r.url is None]


def pool_view(snapshot: RuntimeSnapshot, now: float) -> PoolView:
    """The pool as the gateway's autoscaler sees it: every replica busy (one sequence of
    one), a replica without a URL starting (as the gateway's fleet state makes it)."""
    busy = ReplicaLoad(running=1, observed_at=now)
    replicas = tuple(
        ReplicaView(r.name, POOL, r.state, busy)
        if r.url is not None
        else ReplicaView(r.name, POOL, ReplicaState.STARTING)
        for r in snapshot.replicas
        if r.pool == POOL
    )
    return PoolView(POOL, replicas)


async def test_a_pod_not_in_any_slice_yet_is_published_as_starting_so_the_autoscaler_waits(
    fake: FakeKubeApi,
) -> None:
    """Operator mode used to publish only the pods of the slices: a pod waiting for a GPU
    node (no IP) was missing, so every autoscaler tick saw too few and decided UP again."""
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    config = AutoscaleConfig(min_replicas=2, max_replicas=3, stable_window=10)
    policy = AutoscalePolicy(config, 1)
    async with serving(fake) as url, operator(fake, url) as runtime:
        snapshot = await until(runtime, lambda s: len(s.ready(POOL)) == 2 and s.desired[POOL] == 2)
        assert unseen(snapshot) == []
        first = policy.decide(1.0, pool_view(snapshot, 1.0))
        assert (first.direction, first.desired, first.cold_starts) == (ScaleDirection.UP, 3, 1)
        runtime.scale(POOL, first.desired, first.drain)
        await eventually(lambda: fake.scales[SVC] == 3)  # the third pod is pending: no slice
        snapshot = await until(runtime, lambda s: s.desired[POOL] == 3)
        (pending,) = unseen(snapshot)
        assert (pending.state, pending.phase) == (ReplicaState.STARTING, Phase.STARTING)
        assert len(snapshot.ready(POOL)) == 2  # never routed to

        second = policy.decide(2.0, pool_view(snapshot, 2.0))
        assert (second.direction, second.inputs.current, second.cold_starts) == (
            ScaleDirection.HOLD,
            3,
            0,
        )

        fake.set_pod(SVC, "pod-c", ready=False)  # scheduled: an IP, loading its model
        snapshot = await until(runtime, lambda s: "pod-c" in states(s))
        assert unseen(snapshot) == []  # the pod replaces the placeholder
    assert len(fake.calls_to("PATCH", "/scale")) == 1


async def test_scale_down_drains_the_chosen_pod_then_marks_it_then_lowers_the_count(
    fake: FakeKubeApi,
) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    busy = Busy()
    busy.count["pod-b"] = 3
    async with serving(fake) as url, operator(fake, url, busy) as runtime:
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.READY}))
        runtime.scale(POOL, 1, remove=("pod-b",))
        # the gateway stops routing to it at once ...
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.DRAINING}))
        await eventually(lambda: busy.reads.count("pod-b") >= 3)
        # ... and nothing is patched while it still has requests in flight
        assert fake.calls_to("PATCH", "/pods/") == []
        assert fake.calls_to("PATCH", "/scale") == []
        busy.count["pod-b"] = 0
        await eventually(lambda: fake.scales[SVC] == 1)
        # the ReplicaSet removes the marked pod: the test plays it
        assert fake.pod_annotations["pod-b"] == {DELETION_COST_ANNOTATION: DELETION_COST}
        fake.set_pod(SVC, "pod-b", ready=False, terminating=True)
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.DRAINING}))
        fake.remove_pod(SVC, "pod-b")
        snapshot = await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        assert snapshot.desired[POOL] == 1

    patches = [(c.method, c.path, c.body) for c in fake.calls if c.method == "PATCH"]
    assert patches == [
        (
            "PATCH",
            f"/api/v1/namespaces/{NS}/pods/pod-b",
            {"metadata": {"annotations": {DELETION_COST_ANNOTATION: DELETION_COST}}},
        ),
        ("PATCH", SCALE_PATH, {"spec": {"replicas": 1}}),
    ]
    assert "pod-a" not in busy.reads  # only the victim is drained


async def test_a_drain_that_never_ends_is_cut_at_its_deadline(fake: FakeKubeApi) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    busy = Busy()
    busy.count = {"pod-a": 1, "pod-b": 1}  # a stuck stream
    settings = OperatorSettings(resync_s=0.5, drain_timeout_s=0.2, probe_interval_s=0.01)
    async with serving(fake) as url, operator(fake, url, busy, settings) as runtime:
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        runtime.scale(POOL, 1)  # no choice given: the operator picks one
        await eventually(lambda: fake.scales[SVC] == 1)
    (marked,) = fake.pod_annotations
    assert marked in busy.reads


async def test_a_scale_up_before_the_drain_ends_keeps_the_pod(fake: FakeKubeApi) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    busy = Busy()
    busy.count["pod-b"] = 1
    async with serving(fake) as url, operator(fake, url, busy) as runtime:
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        runtime.scale(POOL, 1, remove=("pod-b",))
        await until(runtime, lambda s: len(s.ready(POOL)) == 1)
        runtime.scale(POOL, 2)
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)  # routed to again
        await asyncio.sleep(0.1)
    assert fake.calls_to("PATCH", "") == []
    assert fake.scales[SVC] == 2


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-status"])
async def test_410_gone_lists_again_and_keeps_the_replicas_in_between(
    fake: FakeKubeApi, as_status: bool
) -> None:
    fake.gone_as_status = as_status
    fake.set_pod(SVC, "pod-a")
    async with serving(fake) as url, operator(fake, url) as runtime:
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        await eventually(lambda: fake.watching() == 1)
        seen: list[dict[str, ReplicaState]] = []
        runtime.subscribe(lambda s: seen.append(states(s)))
        fake.set_pod(SVC, "pod-b")
        fake.compact()  # etcd compacted: the watch's version is gone
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.READY}))
        assert runtime.watch.lists == 2
        assert all("pod-a" in s for s in seen)  # never published empty while relisting
        fake.set_pod(SVC, "pod-c")  # and the new watch follows the new list
        await until(runtime, lambda s: len(s.ready(POOL)) == 3)


async def test_a_watch_the_server_ends_resumes_from_its_version_without_a_list(
    fake: FakeKubeApi,
) -> None:
    fake.set_pod(SVC, "pod-a")
    async with serving(fake) as url, operator(fake, url) as runtime:
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        await eventually(lambda: fake.watching() == 1)
        fake.drop_watches()  # timeoutSeconds reached, or a load balancer cut it
        fake.set_pod(SVC, "pod-b")
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
    watches = [c for c in fake.calls if c.query.get("watch") == "1"]
    assert len(watches) >= 2
    assert watches[1].query["resourceVersion"] == "101"
    assert runtime.watch.lists == 1


@pytest.mark.parametrize("status", [500, 403])
async def test_api_errors_are_retried_and_the_known_replicas_kept(
    fake: FakeKubeApi, status: int
) -> None:
    fake.set_pod(SVC, "pod-a")
    fake.fail("GET", "/endpointslices", status, times=2)  # the first list fails twice
    fake.fail("PATCH", "/scale", status, times=2)
    async with serving(fake) as url, operator(fake, url) as runtime:
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        await eventually(lambda: fake.watching() == 1)
        fake.fail("GET", "/endpointslices", status, times=3)
        fake.drop_watches()  # the next watch fails: nothing is forgotten meanwhile
        await eventually(lambda: runtime.watch.failures > 0)
        assert states(runtime.snapshot) == {"pod-a": ReplicaState.READY}
        fake.set_pod(SVC, "pod-b")
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        runtime.scale(POOL, 3)
        await eventually(lambda: fake.scales[SVC] == 3)
    assert len(fake.calls_to("PATCH", "/scale")) == 3  # two refused, one applied


async def test_an_unreachable_api_server_leaves_the_last_replicas_serving(
    fake: FakeKubeApi,
) -> None:
    fake.set_pod(SVC, "pod-a")
    server = serving(fake)
    url = await server.__aenter__()
    port = int(url.rsplit(":", 1)[1])
    async with operator(fake, url) as runtime:
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY}))
        await server.__aexit__(None, None, None)  # the port is closed: calls are refused
        await eventually(lambda: runtime.watch.failures >= 2)
        fake.set_pod(SVC, "pod-b")
        await asyncio.sleep(0.1)
        assert states(runtime.snapshot) == {"pod-a": ReplicaState.READY}
        async with serving(fake, port):  # the API server is back
            await until(runtime, lambda s: len(s.ready(POOL)) == 2)


async def test_only_the_lease_holder_scales_and_the_others_keep_its_victims_out(
    fake: FakeKubeApi,
) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    busy = Busy()
    busy.count["pod-b"] = 1
    async with serving(fake) as url:
        leaving = AsyncExitStack()  # the first gateway replica, shut down half-way
        leader = await leaving.enter_async_context(operator(fake, url, busy, identity="gw-1"))
        try:
            await eventually(lambda: leader.leading)
            async with operator(fake, url, busy, identity="gw-2") as follower:
                await until(follower, lambda s: len(s.ready(POOL)) == 2)
                assert not follower.leading
                follower.scale(POOL, 3)  # a follower's autoscaler decides, but nothing acts
                await asyncio.sleep(0.2)
                assert fake.calls_to("PATCH", "") == []
                leader.scale(POOL, 1, remove=("pod-b",))
                await until(leader, lambda s: states(s)["pod-b"] is ReplicaState.DRAINING)
                # the follower stops routing to the leader's victim too (its note on the Lease)
                await until(follower, lambda s: states(s)["pod-b"] is ReplicaState.DRAINING)
                busy.count["pod-b"] = 0
                await eventually(lambda: fake.scales[SVC] == 1)
                fake.remove_pod(SVC, "pod-b")  # the ReplicaSet removes the marked pod
                await until(follower, fleet(**{"pod-a": ReplicaState.READY}))
                # the leader shuts down and releases the lease: the follower acts at once
                await leaving.aclose()
                await eventually(lambda: follower.leading, timeout=1.0)  # lease: 3 s
                follower.scale(POOL, 2)
                await eventually(lambda: fake.scales[SVC] == 2)
        finally:
            await leaving.aclose()
    patches = [(c.path, c.body) for c in fake.calls if c.method == "PATCH"]
    assert patches == [
        (
            f"/api/v1/namespaces/{NS}/pods/pod-b",
            {"metadata": {"annotations": {DELETION_COST_ANNOTATION: DELETION_COST}}},
        ),
        (SCALE_PATH, {"spec": {"replicas": 1}}),
        (SCALE_PATH, {"spec": {"replicas": 2}}),
    ]
    assert fake.holder() is None  # both released it on the way out


async def test_a_leader_that_loses_the_lease_stops_draining_and_its_victim_serves_again(
    fake: FakeKubeApi,
) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod)
    busy = Busy()
    busy.count["pod-b"] = 1  # the drain cannot end
    short = LeaseSettings(lease_duration_s=1.0, renew_deadline_s=0.5, retry_period_s=0.05)
    async with (
        serving(fake) as url,
        operator(fake, url, busy, identity="gw-1", lease=short) as runtime,
    ):
        await eventually(lambda: runtime.leading)
        runtime.scale(POOL, 1, remove=("pod-b",))
        await until(runtime, lambda s: states(s)["pod-b"] is ReplicaState.DRAINING)
        fake.fail("GET", "/leases", 500, times=1000)  # the API server fails its renewals
        fake.fail("PUT", "/leases", 500, times=1000)
        await eventually(lambda: not runtime.leading)  # after its 0.5 s renew deadline
        await until(runtime, fleet(**{"pod-a": ReplicaState.READY, "pod-b": ReplicaState.READY}))
        await asyncio.sleep(0.1)
    assert fake.calls_to("PATCH", "") == []
    assert fake.scales[SVC] == 2


async def test_every_call_the_operator_makes_is_allowed_by_the_rendered_role(
    fake: FakeKubeApi,
) -> None:
    for pod in ("pod-a", "pod-b"):
        fake.set_pod(SVC, pod, node="node-1")
    fake.set_node("node-1")
    watching_nodes = dataclasses.replace(FAST, reclaim=reclaim_rules(ReclaimConfig()))
    async with (
        serving(fake) as url,
        operator(fake, url, settings=watching_nodes, identity="gw-1") as runtime,
    ):
        await eventually(lambda: runtime.leading)
        await until(runtime, lambda s: len(s.ready(POOL)) == 2)
        await eventually(lambda: fake.watching("/api/v1/nodes") == 1)
        runtime.scale(POOL, 3)
        await eventually(lambda: fake.scales[SVC] == 3)
        runtime.scale(POOL, 1, remove=("pod-a",))
        await eventually(lambda: fake.scales[SVC] == 1)
        await eventually(lambda: len(fake.calls_to("PUT", "/leases")) > 0)  # a renewal
    objects = render(ClusterFleet(POOLS, "models: []\n"), NS)
    role = next(o for o in objects if o["kind"] == "Role")
    assert {o["metadata"]["name"] for o in [role]} == {GATEWAY}
    # nodes are cluster-scoped: a ClusterRole of its own, bound to the same ServiceAccount
    cluster_role = next(o for o in objects if o["kind"] == "ClusterRole")
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    assert cluster_role["metadata"]["name"] == cluster_role_name(NS) == binding["roleRef"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": NS}]
    used = set()
    for call in fake.calls:
        group, resource, name, namespaced = _resource(call.path)
        verb = {"PATCH": "patch", "PUT": "update", "POST": "create"}.get(call.method) or (
            "watch" if call.query.get("watch") == "1" else "list" if name is None else "get"
        )
        used.add((group, resource, verb))
        # a Role grants nothing cluster-scoped; the ClusterRole, only what the Role cannot
        rules = role["rules"] if namespaced else cluster_role["rules"]
        assert any(
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            # a rule with resourceNames allows only calls that name one of them (RBAC: never
            # a list, a watch without a name field selector, or a create)
            and ("resourceNames" not in rule or name in rule["resourceNames"])
            for rule in rules
        ), (call.method, call.path)
    granted = {
        (g, r, v)
        for rule in [*role["rules"], *cluster_role["rules"]]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert used == granted  # and nothing granted goes unused


def _resource(path: str) -> tuple[str, str, str | None, bool]:
    """``(api group, resource[/subresource], name, namespaced)`` of an API path."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    namespaced = "namespaces" in parts
    rest = (
        parts[parts.index("namespaces") + 2 :] if namespaced else parts[2 if group == "" else 3 :]
    )
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    return group, resource, name, namespaced
