"""Operator mode: replicas are the pods of each pool's Deployment; the gateway finds, scales them.

``KubernetesRuntime`` is the shell around ``plan_pool``: it watches the pools' EndpointSlices
(``SliceWatch``), reads each Deployment's scale, and on every change (and every ``resync_s``)
plans each pool again and carries out the actions: drain a pod (publish it as draining so the
gateway stops routing to it, then poll its ``/metrics`` until nothing runs there or the drain
deadline passes), mark it with the deletion cost, patch the scale. It publishes the same
:class:`RuntimeSnapshot` as the local runtime, so the gateway cannot tell the two apart::

    async with KubeApi(ApiConfig.in_cluster()) as api, KubernetesRuntime(api, "ns", pools) as rt:
        rt.subscribe(on_snapshot)                           # the gateway's replica list
        rt.scale("llama-3.1-8b", 1, remove=("llama-3-1-8b-7d9c-x2x4q",))

With ``settings.reclaim``, it also watches the cluster's nodes (``NodeWatch``): a pod on a
node being taken back (a termination taint, a cordon: ``node_reclaims``) is published with
the node's deadline (``ReplicaStatus.reclaim_at``), which the gateway hands to its pool
controller as a preemption notice. Every replica publishes it, leader or not: each gateway's
controller routes for itself.

With several gateway replicas (``leader=LeaderElection(...)``), only the holder of the Lease
acts: the others publish the same pods, take ``scale`` calls as no-ops, and keep out of
routing the pods the leader says it drains (its note on the Lease). A replica that loses the
lease stops at once: its drains are cancelled and its victims serve again until the new
leader decides for itself.

Everything runs in one ``asyncio.TaskGroup`` owned by the ``async with`` block. A failed call
is logged and retried on the next round (after ``retry_s``); nothing the API server does can
end the block, and an unreachable API server leaves the last known replicas published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Final, Self

import httpx
from prometheus_client import CollectorRegistry, Gauge

from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.runtime._drain import in_flight, wait_idle
from gpufleet.runtime._reconcile import Phase
from gpufleet.runtime._snapshot import ReplicaStatus, RuntimeSnapshot
from gpufleet.runtime._spec import EngineKind, PoolSpec
from gpufleet.runtime.kubernetes._api import KubeApi, KubeApiError
from gpufleet.runtime.kubernetes._discovery import Nodes, NodeWatch, Slices, SliceWatch
from gpufleet.runtime.kubernetes._endpoints import (
    SERVICE_NAME_LABEL,
    PodEndpoint,
    PodState,
    pod_endpoints,
)
from gpufleet.runtime.kubernetes._leader import LeaderElection
from gpufleet.runtime.kubernetes._nodes import Reclaim, ReclaimRules, keep_first, node_reclaims
from gpufleet.runtime.kubernetes._render import pool_object_names
from gpufleet.runtime.kubernetes._scaling import (
    DELETION_COST,
    DELETION_COST_ANNOTATION,
    Action,
    Desired,
    Drain,
    Mark,
    Observed,
    PatchScale,
    plan_pool,
)

logger = logging.getLogger("gpufleet.runtime.kubernetes")

Listener = Callable[[RuntimeSnapshot], None]
InFlight = Callable[[str, str], Awaitable[int | None]]
"""``in_flight(pod, url)``: requests running or waiting on a replica; ``None`` if unknown."""

_STATE: Final = {
    PodState.STARTING: (ReplicaState.STARTING, Phase.STARTING),
    PodState.READY: (ReplicaState.READY, Phase.READY),
    PodState.TERMINATING: (ReplicaState.DRAINING, Phase.STOPPING),
}


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    resync_s: float = 30.0
    """Seconds between two reads of every Deployment's scale (and two full plans)."""
    drain_timeout_s: float = 60.0
    """Longest wait for a victim's in-flight requests before it is removed anyway."""
    probe_interval_s: float = 1.0
    """Seconds between two in-flight reads of a draining pod."""
    retry_s: float = 1.0
    """First delay after a failed API call (the watch doubles it up to 30 s)."""
    watch_timeout_s: int = 300
    """``timeoutSeconds`` of a watch: the server ends it then and it starts again."""
    reclaim: ReclaimRules | None = None
    """Which nodes are being taken back (the fleet file's ``runtime.reclaim``); ``None``:
    nodes are not watched."""


@dataclass(frozen=True, slots=True)
class ClusterPool:
    """A pool as operator mode finds it: its Service (for slices) and Deployment (for scale)."""

    spec: PoolSpec
    service: str
    deployment: str

    @property
    def name(self) -> str:
        return self.spec.name


def cluster_pools(pools: Sequence[PoolSpec]) -> tuple[ClusterPool, ...]:
    """Each pool with the object names ``gpufleet deploy k8s`` gives it (external pools have
    none: their endpoints are routed to as given)."""
    spawned = [p for p in pools if p.engine.kind is not EngineKind.EXTERNAL]
    names = pool_object_names(spawned)
    return tuple(ClusterPool(p, names.get(p.name, ""), names.get(p.name, "")) for p in pools)


@dataclass(slots=True)
class _PoolState:
    pool: ClusterPool
    desired: Desired | None = None
    scale: int | None = None
    drained: set[str] = field(default_factory=set)
    marked: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)
    draining: frozenset[str] = frozenset()
    drains: dict[str, asyncio.Task[None]] = field(default_factory=dict)


class KubernetesRuntime:
    """Discovers and scales the pods of each pool; see the module docstring."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        pools: Sequence[ClusterPool],
        *,
        settings: OperatorSettings | None = None,
        in_flight: InFlight | None = None,
        leader: LeaderElection | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or OperatorSettings()
        self.leader = leader
        self._led = leader is None
        self._resync_now = False
        self._api = api
        self._ns = namespace
        self._pools = {p.name: _PoolState(p) for p in pools}
        self._by_service = {p.service: p.name for p in pools if p.service}
        self._in_flight = in_flight
        self._http: httpx.AsyncClient | None = None
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._by_service))})"
        self.watch = SliceWatch(
            api,
            namespace,
            selector,
            self._slices_changed,
            retry_s=self.settings.retry_s,
            watch_timeout_s=self.settings.watch_timeout_s,
        )
        self.nodes = (
            None
            if self.settings.reclaim is None
            else NodeWatch(
                api,
                self._nodes_changed,
                retry_s=self.settings.retry_s,
                watch_timeout_s=self.settings.watch_timeout_s,
            )
        )
        """The node watch (``None`` without ``settings.reclaim``)."""
        self._wall = wall
        self._reclaims: dict[str, Reclaim] = {}
        self._pods: tuple[PodEndpoint, ...] = ()
        self._snapshot = RuntimeSnapshot(0, ())
        self._listeners: list[Listener] = []
        self._published = asyncio.Event()
        self._wake = asyncio.Event()
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._publish()

    # -- the public face (the same as LocalRuntime's) ---------------------------------------

    @property
    def snapshot(self) -> RuntimeSnapshot:
        return self._snapshot

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with the current snapshot now and with every new one."""
        self._listeners.append(listener)
        listener(self._snapshot)
        return lambda: self._listeners.remove(listener)

    async def wait_for(self, predicate: Callable[[RuntimeSnapshot], bool]) -> RuntimeSnapshot:
        """The first snapshot, from now on, for which ``predicate`` holds."""
        while not predicate(self._snapshot):
            published = self._published
            await published.wait()
        return self._snapshot

    @property
    def leading(self) -> bool:
        """Whether this replica acts on the cluster (always, without a ``leader``)."""
        return self.leader is None or self.leader.leading

    def scale(self, pool: str, count: int, remove: Sequence[str] = ()) -> None:
        """Want ``count`` replicas in ``pool``; on a scale-down, remove the pods named in
        ``remove`` first (after draining them). Returns at once; the reconcile loop acts.
        A replica that does not hold the Lease ignores it (the leader's autoscaler decides)."""
        state = self._pools.get(pool)
        if state is None:
            raise KeyError(f"unknown pool {pool!r}")
        if state.pool.spec.engine.kind is EngineKind.EXTERNAL:
            raise ValueError(f"pool {pool!r} is external: nothing here can scale it")
        if not self.leading:
            logger.debug("pool %s: not the leader; scale to %d left to the leader", pool, count)
            return
        state.desired = Desired(count, tuple(remove))
        self._wake.set()

    # -- lifetime -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._spawn(self._run(), "k8s-operator")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        assert self._http is not None
        for task in self._tasks:  # the block's end stops everything: nothing ends by itself
            task.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            await self._http.aclose()

    async def _run(self) -> None:
        if self._by_service:
            self._spawn(self.watch.run(), "k8s-endpointslices")
            if self.nodes is not None:
                self._spawn(self.nodes.run(), "k8s-nodes")
        if self.leader is not None:
            self.leader.subscribe(self._leadership_changed)
            self._spawn(self.leader.run(), "k8s-leader-election")
        loop = asyncio.get_running_loop()
        next_resync = loop.time()
        while True:
            if self._resync_now:  # a new leader reads the scales before it acts
                self._resync_now, next_resync = False, loop.time()
            if loop.time() >= next_resync:
                read = await self._read_scales()
                wait = self.settings.resync_s if read else self.settings.retry_s
                next_resync = loop.time() + wait
            failed = await self._reconcile()
            timeout = next_resync - loop.time()
            if failed:
                timeout = min(timeout, self.settings.retry_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, timeout)):
                    await self._wake.wait()
            self._wake.clear()

    def _leadership_changed(self, leading: bool) -> None:
        if leading != self._led:
            self._led = leading
            if leading:
                self._resync_now = True
            else:  # stop acting at once: the new leader decides afresh
                for state in self._pools.values():
                    for task in state.drains.values():
                        task.cancel()
                    state.drains.clear()
                    state.drained.clear()
                    state.marked.clear()
                    state.desired = None
        self._wake.set()

    # -- observe --------------------------------------------------------------------------

    def _slices_changed(self, slices: Slices) -> None:
        self._pods = pod_endpoints(slices.values(), self._by_service)
        self._wake.set()
        self._publish()

    def _nodes_changed(self, nodes: Nodes) -> None:
        rules = self.settings.reclaim
        assert rules is not None
        now = self._wall()
        old, self._reclaims = (
            self._reclaims,
            keep_first(self._reclaims, node_reclaims(nodes.values(), rules, now)),
        )
        for node, reclaim in self._reclaims.items():
            if old.get(node) != reclaim:
                pods = ", ".join(p.name for p in self._pods if p.node == node) or "none of ours"
                logger.warning(
                    "node %s is being taken back (%s) in %.0f s; its pods: %s",
                    node,
                    reclaim.reason,
                    max(0.0, reclaim.at - now),
                    pods,
                )
        self._publish()

    async def _read_scales(self) -> bool:
        """Read every pool's Deployment scale; ``False`` if a read failed."""
        ok = True
        for state in self._pools.values():
            if not state.pool.deployment:
                continue
            try:
                body = await self._api.get(self._scale_path(state.pool))
            except KubeApiError as error:
                logger.warning("pool %s: cannot read its scale: %s", state.pool.name, error)
                ok = False
                continue
            state.scale = int(body.get("spec", {}).get("replicas", 0))
        return ok

    # -- reconcile ------------------------------------------------------------------------

    async def _reconcile(self) -> bool:
        """Plan every pool and carry out its actions; ``True`` if an action failed."""
        failed = False
        leading = self.leading
        peer = frozenset(self.leader.peer_note.split(",") if self.leader is not None else ())
        for state in self._pools.values():
            if not state.pool.deployment:
                continue
            pods = tuple(p for p in self._pods if p.pool == state.pool.name)
            names = {p.name for p in pods}
            for kept in (state.drained, state.marked, state.retired):
                kept.intersection_update(names)  # forget pods that are gone
            if not leading:  # route, never act; keep out what the leader drains
                self._set_draining(state, frozenset(names & peer))
                continue
            observed = Observed(
                state.scale,
                pods,
                frozenset(state.drained),
                frozenset(state.marked),
                frozenset(state.retired),
            )
            plan = plan_pool(state.pool.name, state.desired, observed)
            self._set_draining(state, plan.draining)
            for action in plan.actions:
                try:
                    await self._apply(state, action)
                except KubeApiError as error:
                    logger.warning("pool %s: %s failed: %s", state.pool.name, action, error)
                    failed = True
                    break
        if leading and self.leader is not None:  # the other replicas stop routing to them too
            draining = (pod for state in self._pools.values() for pod in state.draining)
            self.leader.set_note(",".join(sorted(draining)))
        self._publish()
        return failed

    def _set_draining(self, state: _PoolState, draining: frozenset[str]) -> None:
        """Victims that are no longer victims (a scale-up came first) serve again."""
        for pod in state.draining - draining:
            task = state.drains.pop(pod, None)
            if task is not None:
                task.cancel()
            state.drained.discard(pod)
            state.marked.discard(pod)
        state.draining = draining

    async def _apply(self, state: _PoolState, action: Action) -> None:
        match action:
            case Drain(pod=pod, url=url):
                if pod not in state.drains:
                    self._publish()  # the gateway stops routing to it before we wait
                    state.drains[pod] = self._spawn(self._drain(state, pod, url), f"drain-{pod}")
            case Mark(pod=pod):
                body = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: DELETION_COST}}}
                try:
                    await self._api.patch(f"/api/v1/namespaces/{self._ns}/pods/{pod}", body)
                except KubeApiError as error:
                    if error.status != 404:  # a pod that is gone needs no mark
                        raise
                state.marked.add(pod)
                self._wake.set()
            case PatchScale(replicas=replicas, retire=retire):
                reply = await self._api.patch(
                    self._scale_path(state.pool), {"spec": {"replicas": replicas}}
                )
                state.scale = int(reply.get("spec", {}).get("replicas", replicas))
                state.retired.update(retire)
                if state.desired is not None and state.desired.count == state.scale:
                    state.desired = Desired(state.scale)  # done: forget the victims
                logger.info("pool %s: scaled to %d", state.pool.name, state.scale)
                self._wake.set()

    async def _drain(self, state: _PoolState, pod: str, url: str) -> None:
        try:
            async with asyncio.timeout(self.settings.drain_timeout_s):
                await wait_idle(lambda: self._busy(pod, url), self.settings.probe_interval_s)
        except TimeoutError:
            logger.warning(
                "pool %s: pod %s still busy after %.0f s of drain; removing it anyway",
                state.pool.name,
                pod,
                self.settings.drain_timeout_s,
            )
        state.drains.pop(pod, None)
        state.drained.add(pod)
        self._wake.set()

    async def _busy(self, pod: str, url: str) -> int | None:
        if self._in_flight is not None:
            return await self._in_flight(pod, url)
        assert self._http is not None
        try:
            return in_flight((await self._http.get(url + "/metrics")).text)
        except (httpx.HTTPError, ValueError):
            return None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        assert self._tg is not None
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _scale_path(self, pool: ClusterPool) -> str:
        return f"/apis/apps/v1/namespaces/{self._ns}/deployments/{pool.deployment}/scale"

    # -- publish --------------------------------------------------------------------------

    def _publish(self) -> None:
        replicas: list[ReplicaStatus] = []
        desired: dict[str, int] = {}
        for state in self._pools.values():
            spec = state.pool.spec
            engine = spec.engine
            if engine.kind is EngineKind.EXTERNAL:
                replicas += [
                    _status(spec, ReplicaId(f"{spec.name}-{i}"), url, PodState.READY)
                    for i, url in enumerate(engine.endpoints[: spec.replicas])
                ]
                desired[spec.name] = spec.replicas
                continue
            live = 0
            for pod in self._pods:
                if pod.pool == spec.name:
                    shown = PodState.TERMINATING if pod.name in state.draining else pod.state
                    reclaim = self._reclaims.get(pod.node) if pod.node is not None else None
                    at = None if reclaim is None else reclaim.at
                    replicas.append(_status(spec, ReplicaId(pod.name), pod.url, shown, at))
                    live += shown is not PodState.TERMINATING
            wanted = state.desired.count if state.desired is not None else state.scale
            desired[spec.name] = spec.replicas if wanted is None else wanted
            if wanted is not None:
                replicas += _unseen(spec, wanted - live)
        old = self._snapshot
        if old.version and (tuple(replicas), desired) == (old.replicas, dict(old.desired)):
            return
        self._snapshot = RuntimeSnapshot(
            old.version + 1, tuple(replicas), MappingProxyType(desired)
        )
        for listener in list(self._listeners):
            try:
                listener(self._snapshot)
            except Exception:
                logger.exception("runtime listener %r failed", listener)
        published, self._published = self._published, asyncio.Event()
        published.set()


LEADER_METRIC: Final = "gpufleet:operator_leader"


def export_leadership(runtime: KubernetesRuntime, registry: CollectorRegistry) -> None:
    """``gpufleet:operator_leader``: 1 on the gateway replica whose autoscaler acts."""
    gauge = Gauge(
        LEADER_METRIC,
        "1 while this gateway replica holds the Lease (or needs none): its autoscaler acts.",
        registry=registry,
    )
    gauge.set_function(lambda: 1.0 if runtime.leading else 0.0)


def _unseen(spec: PoolSpec, count: int) -> list[ReplicaStatus]:
    """Pods the Deployment wants that no EndpointSlice lists yet (pending: no GPU node, no
    IP): published as starting, with no URL, so the autoscaler counts them as capacity to
    come (else it asks for them again every tick) and the gateway never routes to them."""
    return [
        _status(spec, ReplicaId(f"{spec.name}-unseen-{i}"), None, PodState.STARTING)
        for i in range(max(0, count))
    ]


def _status(
    spec: PoolSpec,
    name: ReplicaId,
    url: str | None,
    pod: PodState,
    reclaim_at: float | None = None,
) -> ReplicaStatus:
    state, phase = _STATE[pod]
    return ReplicaStatus(
        name=name,
        pool=spec.name,
        model=spec.engine.served_name,
        engine=spec.engine.kind,
        state=state,
        phase=phase,
        url=url,
        pid=None,
        restarts=0,
        log=None,
        last_error=None,
        reclaim_at=reclaim_at,
    )
