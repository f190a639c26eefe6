"""Kubernetes: the fleet file as plain manifests, and operator mode.

``render(fleet, namespace, image_tag)`` turns a :class:`ClusterFleet` (the runtime's pools
plus the fleet file's text) into Kubernetes objects, pure and deterministic;
``manifest_files`` names and serialises them, one file per object. ``gpufleet deploy k8s``
is the command; docs/kubernetes.md says how to apply the result to a GPU cluster.

Operator mode (``runtime: kubernetes``): :class:`KubernetesRuntime` finds each pool's ready
pods through an EndpointSlice watch and publishes them as the local runtime does; its
``scale(pool, count, remove)`` drains the chosen pods, marks them with the pod-deletion cost
and patches the pool Deployment's scale (a pure plan, ``plan_pool``, decides each step).
With ``OperatorSettings.reclaim``, a node watch (:class:`NodeWatch`) finds the nodes being
taken back (``node_reclaims``: termination taints, cordons) and publishes their deadline on
the replicas they host; the gateway's controller drains them (``Preempting``).
With several gateway replicas, :class:`LeaderElection` on a Lease picks the one that scales.
``dashboard()`` is the Grafana dashboard of the gateway, its autoscaler and the engines.
"""

from gpufleet.runtime.kubernetes._api import (
    ApiConfig,
    KubeApi,
    KubeApiError,
    in_cluster_namespace,
)
from gpufleet.runtime.kubernetes._dashboard import (
    DASHBOARD_FILE,
    DASHBOARD_UID,
    dashboard,
    dashboard_json,
)
from gpufleet.runtime.kubernetes._discovery import NODES_PATH, NodeWatch, SliceWatch
from gpufleet.runtime.kubernetes._endpoints import PodEndpoint, PodState, pod_endpoints
from gpufleet.runtime.kubernetes._files import manifest_files, to_yaml
from gpufleet.runtime.kubernetes._gpus import (
    GPU_PRODUCT_LABEL,
    GPU_PRODUCTS,
    GPU_RESOURCE,
    gpu_product,
)
from gpufleet.runtime.kubernetes._leader import (
    NOTE_ANNOTATION,
    LeaderElection,
    LeaseSettings,
    default_identity,
)
from gpufleet.runtime.kubernetes._nodes import (
    CORDON,
    Reclaim,
    ReclaimRules,
    ReclaimTaint,
    keep_first,
    node_reclaims,
    trim_node,
)
from gpufleet.runtime.kubernetes._operator import (
    LEADER_METRIC,
    ClusterPool,
    KubernetesRuntime,
    OperatorSettings,
    cluster_pools,
    export_leadership,
)
from gpufleet.runtime.kubernetes._render import (
    DASHBOARDS,
    FLEET_KEY,
    GATEWAY,
    GATEWAY_IMAGE,
    GRAFANA_LABEL,
    PORT,
    SPOT_TOLERATIONS,
    VLLM_IMAGE,
    VLLM_TAG,
    ClusterFleet,
    Manifest,
    SpotPlacement,
    cluster_role_name,
    notes,
    pool_object_names,
    render,
    sim_args,
    vllm_args,
)
from gpufleet.runtime.kubernetes._scaling import (
    DELETION_COST,
    DELETION_COST_ANNOTATION,
    Desired,
    Drain,
    Mark,
    Observed,
    PatchScale,
    PoolPlan,
    plan_pool,
)

__all__ = [
    "CORDON",
    "DASHBOARDS",
    "DASHBOARD_FILE",
    "DASHBOARD_UID",
    "DELETION_COST",
    "DELETION_COST_ANNOTATION",
    "FLEET_KEY",
    "GATEWAY",
    "GATEWAY_IMAGE",
    "GPU_PRODUCTS",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "GRAFANA_LABEL",
    "LEADER_METRIC",
    "NODES_PATH",
    "NOTE_ANNOTATION",
    "PORT",
    "SPOT_TOLERATIONS",
    "VLLM_IMAGE",
    "VLLM_TAG",
    "ApiConfig",
    "ClusterFleet",
    "ClusterPool",
    "Desired",
    "Drain",
    "KubeApi",
    "KubeApiError",
    "KubernetesRuntime",
    "LeaderElection",
    "LeaseSettings",
    "Manifest",
    "Mark",
    "NodeWatch",
    "Observed",
    "OperatorSettings",
    "PatchScale",
    "PodEndpoint",
    "PodState",
    "PoolPlan",
    "Reclaim",
    "ReclaimRules",
    "ReclaimTaint",
    "SliceWatch",
    "SpotPlacement",
    "cluster_pools",
    "cluster_role_name",
    "dashboard",
    "dashboard_json",
    "default_identity",
    "export_leadership",
    "gpu_product",
    "in_cluster_namespace",
    "keep_first",
    "manifest_files",
    "node_reclaims",
    "notes",
    "plan_pool",
    "pod_endpoints",
    "pool_object_names",
    "render",
    "sim_args",
    "to_yaml",
    "trim_node",
    "vllm_args",
]
