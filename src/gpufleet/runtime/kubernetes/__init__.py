"""Kubernetes: the fleet file as plain manifests (operator mode is not built yet).

``render(fleet, namespace, image_tag)`` turns a :class:`ClusterFleet` (the runtime's pools
plus the fleet file's text) into Kubernetes objects, pure and deterministic;
``manifest_files`` names and serialises them, one file per object. ``gpufleet deploy k8s``
is the command; docs/kubernetes.md says how to apply the result to a GPU cluster.
"""

from gpufleet.runtime.kubernetes._files import manifest_files, to_yaml
from gpufleet.runtime.kubernetes._gpus import (
    GPU_PRODUCT_LABEL,
    GPU_PRODUCTS,
    GPU_RESOURCE,
    gpu_product,
)
from gpufleet.runtime.kubernetes._render import (
    FLEET_KEY,
    GATEWAY,
    GATEWAY_IMAGE,
    PORT,
    VLLM_IMAGE,
    VLLM_TAG,
    ClusterFleet,
    Manifest,
    notes,
    pool_object_names,
    render,
    sim_args,
    vllm_args,
)

__all__ = [
    "FLEET_KEY",
    "GATEWAY",
    "GATEWAY_IMAGE",
    "GPU_PRODUCTS",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "PORT",
    "VLLM_IMAGE",
    "VLLM_TAG",
    "ClusterFleet",
    "Manifest",
    "gpu_product",
    "manifest_files",
    "notes",
    "pool_object_names",
    "render",
    "sim_args",
    "to_yaml",
    "vllm_args",
]
