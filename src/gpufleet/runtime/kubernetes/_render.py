"""Kubernetes objects for a fleet: a pure function from plain data to manifests.

``render(fleet, namespace, image_tag)`` returns the objects in the order they should be
applied (the namespace, the gateway's identity and rights, its config, the gateway, then
each pool), as plain dicts that ``yaml.safe_dump`` writes as they are::

    Namespace               gpufleet
    ServiceAccount, Role, RoleBinding, ConfigMap, Deployment, Service    gpufleet-gateway
    ClusterRole, ClusterRoleBinding      gpufleet-gateway-<namespace>  (watch_nodes, any pool)
    Deployment, Service (headless), PodDisruptionBudget                  per sim/vllm pool
    ServiceMonitor          gpufleet-gateway, gpufleet-engines          (service_monitor=True)
    ConfigMap               gpufleet-dashboards: Grafana's dashboard     (grafana=True)

An ``external`` pool renders nothing: someone else runs its replicas (``notes`` says so).

Nothing here reads a file, the clock or the environment, and every name is derived from the
fleet, so rendering the same fleet twice gives the same objects, in the same order.

The drain of a replica pod, from the moment Kubernetes decides to stop it::

    0 s          PRESTOP_S                 PRESTOP_S + drain_s          grace period
    |-- preStop sleep --|-- SIGTERM: the engine drains --|-- spare --|-- SIGKILL
    endpoints drop the pod; routers stop picking it      in-flight requests finish

``drain_s`` is vLLM's ``--shutdown-timeout`` (vLLM ≥ 0.18); the grace period covers all three.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpufleet.runtime._spec import EngineKind, EngineSpec, PoolSpec
from gpufleet.runtime.kubernetes._dashboard import DASHBOARD_FILE, dashboard_json
from gpufleet.runtime.kubernetes._gpus import GPU_PRODUCT_LABEL, GPU_RESOURCE, gpu_product

Manifest = dict[str, Any]
"""One Kubernetes object, as ``kubectl apply`` reads it from YAML."""

VLLM_IMAGE: Final = "vllm/vllm-openai"
VLLM_TAG: Final = "v0.18.0"
"""The default engine image tag: the first vLLM release with ``--shutdown-timeout``."""
GATEWAY_IMAGE: Final = "gpufleet:0.1.0"
"""The gpufleet image (gateway and sim engines). No public image exists: build and push one
(docs/kubernetes.md), then pass its reference as ``gateway_image``."""

PORT: Final = 8000
"""The port every container listens on (engine and gateway), named ``http``."""
PRESTOP_S: Final = 15
"""Seconds between a pod's removal from its endpoints and its SIGTERM (see the diagram)."""
GRACE_SPARE_S: Final = 15
"""Seconds left after the drain for the process to exit before SIGKILL."""
MODEL_LOAD_BUDGET_S: Final = 1800
"""How long a vLLM pod may take to download and load its weights before it is restarted."""
SIM_START_BUDGET_S: Final = 120
SHM_SIZE: Final = "16Gi"
"""``/dev/shm`` for NCCL and vLLM's worker processes (counted only as it is used)."""
FLEET_KEY: Final = "fleet.yaml"
FLEET_DIR: Final = "/etc/gpufleet"

GATEWAY: Final = "gpufleet-gateway"
ENGINES_MONITOR: Final = "gpufleet-engines"
DASHBOARDS: Final = "gpufleet-dashboards"
GRAFANA_LABEL: Final = "grafana_dashboard"
"""The label Grafana's dashboard sidecar (kube-prometheus-stack, the Grafana chart) looks for."""
PART_OF: Final = "gpufleet"
COMPONENT_LABEL: Final = "gpufleet/component"
POOL_LABEL: Final = "gpufleet/pool"
ENGINE_LABEL: Final = "gpufleet/engine"
FLEET_HASH: Final = "gpufleet/fleet-sha256"
"""Pod-template annotation: a changed fleet file rolls the gateway's pods."""

RBAC_GROUP: Final = "rbac.authorization.k8s.io"
_NAME_MAX: Final = 63
_LABEL: Final = re.compile(r"[a-z]([a-z0-9-]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class SpotPlacement:
    """Where a spot pool's pods go: nodes labelled ``label=value`` (a node pool's capacity
    type), as a requirement (``spot.fallback: wait``: no spot node, no pod) or a preference
    (``on_demand``: the scheduler and the node provisioner fall back to other nodes)."""

    label: str
    value: str
    required: bool


SPOT_TOLERATIONS: Final = (
    {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
     "effect": "NoSchedule"},
    {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
     "effect": "NoSchedule"},
)  # fmt: skip
"""The taints clouds may put on their spot nodes (GKE when asked; AKS always): a spot
pool's pods tolerate them."""


@dataclass(frozen=True, slots=True)
class ClusterFleet:
    """What ``render`` needs from a fleet file, as plain data (the runtime reads no config).

    ``pools`` are the runtime's pools (``gpufleet up`` builds the same ones); ``fleet_yaml``
    is the fleet file as written, for the gateway's ConfigMap; ``drain_s`` bounds how long a
    stopping replica waits for its in-flight requests.
    """

    pools: tuple[PoolSpec, ...]
    fleet_yaml: str
    drain_s: int = 60
    gateway_replicas: int = 1
    """One without a shared store; two when the fleet file names a Redis (``gateway.redis_url``),
    so that one gateway pod can be lost or rolled while the other serves."""
    watch_nodes: bool = True
    """The gateway watches the cluster's nodes for reclaims (``runtime.reclaim.enabled``):
    nodes are cluster-scoped, so that takes a ClusterRole."""
    spot: Mapping[str, SpotPlacement] = field(default_factory=dict)
    """The ``capacity: spot`` pools, by name, and the nodes they go to."""

    def __post_init__(self) -> None:
        if self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {self.drain_s}")
        if self.gateway_replicas < 1:
            raise ValueError(f"gateway_replicas must be >= 1, got {self.gateway_replicas}")


def render(
    fleet: ClusterFleet,
    namespace: str = "gpufleet",
    image_tag: str = VLLM_TAG,
    *,
    gateway_image: str = GATEWAY_IMAGE,
    service_monitor: bool = False,
    grafana: bool = False,
) -> list[Manifest]:
    """Every object of the fleet, in apply order. ``ValueError`` for what cannot be rendered
    (a namespace or pool that makes no valid object name, a GPU without a node label)."""
    if not _LABEL.fullmatch(namespace) or len(namespace) > _NAME_MAX:
        raise ValueError(f"namespace {namespace!r} is not a DNS label (a-z, 0-9, '-')")
    pools = [p for p in fleet.pools if p.engine.kind is not EngineKind.EXTERNAL]
    names = pool_object_names(pools)
    ctx = _Context(namespace, f"{VLLM_IMAGE}:{image_tag}", gateway_image, fleet.drain_s)
    objects: list[Manifest] = [_namespace(namespace)]
    objects += _gateway(ctx, fleet, [names[p.name] for p in pools])
    for pool in pools:
        objects += _pool(ctx, pool, names[pool.name], fleet.spot.get(pool.name))
    if service_monitor:
        objects += [
            _service_monitor(ctx, GATEWAY, "gateway"),
            _service_monitor(ctx, ENGINES_MONITOR, "engine"),
        ]
    if grafana:
        objects.append(_dashboards(ctx))
    return objects


def notes(fleet: ClusterFleet) -> list[str]:
    """One line per pool that renders nothing (``external``), for the command to print."""
    return [
        f"{p.name}: external ({', '.join(p.engine.endpoints)}): nothing rendered, the gateway "
        "routes to these endpoints"
        for p in fleet.pools
        if p.engine.kind is EngineKind.EXTERNAL
    ]


def pool_object_names(pools: Sequence[PoolSpec]) -> dict[str, str]:
    """Each pool's object name: its name as a DNS-1035 label (``llama-3.1-8b`` →
    ``llama-3-1-8b``). Services need that form; a long name is cut and given a hash suffix."""
    names: dict[str, str] = {}
    for pool in pools:
        name = pool.name.replace(".", "-")
        if not name[0].isalpha():
            name = f"pool-{name}"
        if len(name) > _NAME_MAX:
            digest = hashlib.sha256(pool.name.encode()).hexdigest()[:8]
            name = f"{name[: _NAME_MAX - 9].rstrip('-')}-{digest}"
        taken = {*names.values(), GATEWAY, ENGINES_MONITOR, DASHBOARDS}
        if name in taken:
            raise ValueError(f"pool {pool.name!r}: its object name {name!r} is already taken")
        names[pool.name] = name
    return names


@dataclass(frozen=True, slots=True)
class _Context:
    namespace: str
    vllm_image: str
    gateway_image: str
    drain_s: int

    def meta(self, name: str, labels: Mapping[str, str]) -> Manifest:
        return {"name": name, "namespace": self.namespace, "labels": dict(labels)}


def cluster_role_name(namespace: str) -> str:
    """The gateway's ClusterRole and ClusterRoleBinding: cluster-scoped, so named after the
    namespace too (two fleets in two namespaces get one each)."""
    return f"{GATEWAY}-{namespace}"


def _labels(component: str, **more: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": "gpufleet",
        COMPONENT_LABEL: component,
        **more,
    }


def _namespace(namespace: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {"app.kubernetes.io/part-of": PART_OF}},
    }


# --- the gateway -----------------------------------------------------------------------------


def _gateway(ctx: _Context, fleet: ClusterFleet, deployments: Sequence[str]) -> list[Manifest]:
    labels = _labels("gateway")
    selector = {COMPONENT_LABEL: "gateway", "app.kubernetes.io/part-of": PART_OF}
    meta = ctx.meta(GATEWAY, labels)
    rules: list[Manifest] = [
        # discovery: list + watch (never get: slices are read only through the watch)
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        # scale-down: the pod-deletion-cost annotation on the drained pod (pod names are not
        # known in advance, so no resourceNames; patch only: no read, no delete)
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
    ]
    if deployments:  # resourceNames: the scale of its own pools, and no other Deployment's
        rules += [
            {
                "apiGroups": ["apps"],
                "resources": ["deployments/scale"],
                "resourceNames": list(deployments),
                "verbs": ["get", "patch"],
            },
            # leader election among the gateway replicas (only the leader scales): read and
            # renew its own Lease; create cannot be limited to a name (RBAC knows no name yet)
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [GATEWAY],
                "verbs": ["get", "update"],
            },
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        ]
    cluster_rbac = _cluster_rbac(ctx, labels) if fleet.watch_nodes and deployments else []
    fleet_hash = hashlib.sha256(fleet.fleet_yaml.encode()).hexdigest()
    container = {
        "name": "gateway",
        "image": ctx.gateway_image,
        "command": ["gpufleet", "up"],
        "args": [
            *("--fleet", f"{FLEET_DIR}/{FLEET_KEY}"),
            *("--host", "0.0.0.0", "--port", str(PORT)),
            *("--runtime", "kubernetes"),  # operator mode, whatever the file's `runtime` says
        ],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health", period=2, failures=SIM_START_BUDGET_S // 2),
        "readinessProbe": _probe("/ready", period=5, failures=2),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "volumeMounts": [{"name": "fleet", "mountPath": FLEET_DIR, "readOnly": True}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY},
            "subjects": [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": ctx.namespace}],
        },
        *cluster_rbac,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {FLEET_KEY: fleet.fleet_yaml},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": fleet.gateway_replicas,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {"labels": labels, "annotations": {FLEET_HASH: fleet_hash}},
                    "spec": {
                        "serviceAccountName": GATEWAY,
                        "enableServiceLinks": False,
                        "terminationGracePeriodSeconds": _grace(ctx.drain_s),
                        "containers": [
                            {**container, "lifecycle": _pre_stop()},
                        ],
                        "volumes": [
                            {"name": "fleet", "configMap": {"name": GATEWAY}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": selector,
                "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        },
    ]


def _cluster_rbac(ctx: _Context, labels: Mapping[str, str]) -> list[Manifest]:
    """Read access to nodes (cluster-scoped: a Role cannot grant it): the reclaim watch lists
    and watches them, and reads nothing else of the cluster."""
    name = cluster_role_name(ctx.namespace)
    meta = {"name": name, "labels": dict(labels)}  # no namespace: cluster-scoped
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": ctx.namespace}],
        },
    ]


# --- one pool of engine replicas -------------------------------------------------------------


def _pool(
    ctx: _Context, pool: PoolSpec, name: str, spot: SpotPlacement | None = None
) -> list[Manifest]:
    engine = pool.engine
    labels = _labels("engine", **{POOL_LABEL: pool.name, ENGINE_LABEL: engine.kind.value})
    selector = {COMPONENT_LABEL: "engine", POOL_LABEL: pool.name}
    meta = ctx.meta(name, labels)
    pod = _vllm_pod(ctx, pool) if engine.kind is EngineKind.VLLM else _sim_pod(ctx, pool)
    if spot is not None:
        _on_spot(pod, spot)
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": pool.replicas,
                "selector": {"matchLabels": selector},
                # keep every ready replica until its successor is ready (needs one spare GPU
                # set per pool during a rollout: the N+1 the planner sizes for)
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "clusterIP": "None",  # headless: one DNS record and endpoint per ready pod
                "selector": selector,
                "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        },
    ]


def _on_spot(pod: dict[str, Any], spot: SpotPlacement) -> None:
    """Send a spot pool's pods to spot nodes: required, or preferred (then the scheduler,
    and a node provisioner such as Karpenter, fall back to on-demand nodes when no spot one
    can be had: ``spot.fallback: on_demand``, docs/spot.md). They tolerate spot taints."""
    expression = {"key": spot.label, "operator": "In", "values": [spot.value]}
    affinity = pod.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    if spot.required:
        required = affinity.setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": [{}]}
        )
        for term in required["nodeSelectorTerms"]:  # every term (they are ORed)
            term.setdefault("matchExpressions", []).append(expression)
    else:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 100, "preference": {"matchExpressions": [expression]}}
        ]
    pod["tolerations"] = [*pod.get("tolerations", []), *SPOT_TOLERATIONS]


def vllm_args(pool: PoolSpec, drain_s: int) -> list[str]:
    """``vllm serve`` arguments of a pool's pods: the engine flags come last, as the local
    runtime writes them (``launch_plan``), so a pass-through flag of ``args`` wins."""
    engine = pool.engine
    return [
        engine.model,
        *("--host", "0.0.0.0", "--port", str(PORT)),
        *("--served-model-name", engine.served_model_name or engine.model),
        *("--shutdown-timeout", str(drain_s)),
        *engine.profile.to_argv(),
    ]


def _startup_checks(engine: EngineSpec) -> int:
    """Failed startup probes (10 s apart) allowed: the engine's startup budget, or ours."""
    budget = engine.ready_timeout_s or MODEL_LOAD_BUDGET_S
    return max(1, math.ceil(budget / 10))


def sim_args(pool: PoolSpec) -> list[str]:
    """``gpufleet engine sim`` arguments of a sim pool's pods (no GPU: the engine models one)."""
    engine = pool.engine
    names = ("--served-model-name", engine.served_model_name) if engine.served_model_name else ()
    return [
        *("--model", engine.model, "--gpu", engine.gpu),
        *("--host", "0.0.0.0", "--port", str(PORT)),
        *names,
        *engine.profile.to_argv(),
    ]


def _vllm_pod(ctx: _Context, pool: PoolSpec) -> Manifest:
    engine = pool.engine
    container = {
        "name": "vllm",
        "image": ctx.vllm_image,
        "command": ["vllm", "serve"],  # exec form: vLLM itself gets the SIGTERM and drains
        "args": vllm_args(pool, ctx.drain_s),
        "env": [
            {
                "name": "HF_TOKEN",  # gated models; the Secret is optional
                "valueFrom": {
                    "secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}
                },
            },
            *({"name": name, "value": value} for name, value in sorted(engine.env.items())),
        ],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": {"limits": {GPU_RESOURCE: engine.profile.tp}},
        "startupProbe": _probe("/health", period=10, failures=_startup_checks(engine)),
        "readinessProbe": _probe("/health", period=5, failures=2),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "lifecycle": _pre_stop(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "enableServiceLinks": False,  # a Service named vllm would set VLLM_PORT, which vLLM reads
        "terminationGracePeriodSeconds": _grace(ctx.drain_s),
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": GPU_PRODUCT_LABEL,
                                    "operator": "In",
                                    "values": [gpu_product(engine.gpu)],
                                }
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}],
    }


def _sim_pod(ctx: _Context, pool: PoolSpec) -> Manifest:
    container = {
        "name": "engine",
        "image": ctx.gateway_image,
        "command": ["gpufleet", "engine", "sim"],
        "args": sim_args(pool),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health", period=2, failures=SIM_START_BUDGET_S // 2),
        "readinessProbe": _probe("/health", period=5, failures=2),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "lifecycle": _pre_stop(),
    }
    return {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": _grace(ctx.drain_s),
        "containers": [container],
    }


def _probe(path: str, *, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": min(period, 5),
        "failureThreshold": failures,
    }


def _pre_stop() -> Manifest:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}


def _grace(drain_s: int) -> int:
    return PRESTOP_S + drain_s + GRACE_SPARE_S


def _service_monitor(ctx: _Context, name: str, component: str) -> Manifest:
    """A Prometheus Operator ServiceMonitor (a CRD: ``monitoring.coreos.com/v1``)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": ctx.meta(name, _labels(component)),
        "spec": {
            "selector": {
                "matchLabels": {COMPONENT_LABEL: component, "app.kubernetes.io/part-of": PART_OF}
            },
            "namespaceSelector": {"matchNames": [ctx.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def _dashboards(ctx: _Context) -> Manifest:
    """The Grafana dashboard as a ConfigMap the Grafana sidecar imports (its label)."""
    meta = ctx.meta(DASHBOARDS, {**_labels("dashboards"), GRAFANA_LABEL: "1"})
    meta["annotations"] = {"grafana_folder": "gpufleet"}  # the sidecar's folderAnnotation
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {DASHBOARD_FILE: dashboard_json()},
    }
