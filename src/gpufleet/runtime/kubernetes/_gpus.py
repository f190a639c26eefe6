"""Catalog GPU names → the ``nvidia.com/gpu.product`` node label that selects them.

The label is set by NVIDIA GPU Feature Discovery (GFD, part of the NVIDIA GPU Operator and
of the ``k8s-device-plugin`` Helm chart): its value is the device name that NVML reports
(``nvidia-smi --query-gpu=name``) with each space replaced by ``-``. So an H100 SXM5 node,
whose GPUs NVML names ``NVIDIA H100 80GB HBM3``, carries
``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``. Check a node with::

    kubectl get nodes -L nvidia.com/gpu.product

Two GFD settings change the value, and a cluster that uses them must pass its own label
(docs/kubernetes.md): MIG in the ``mixed`` or ``single`` strategy appends the MIG profile
(``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``), and time-slicing or MPS sharing appends ``-SHARED``.

AMD GPUs (``mi300x``) are advertised by AMD's device plugin under other names
(``amd.com/gpu``); they have no entry here yet and rendering refuses them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
"""The node label GFD sets to the GPU's NVML name, spaces as ``-``."""

GPU_RESOURCE: Final = "nvidia.com/gpu"
"""The extended resource the NVIDIA device plugin advertises (one unit per whole GPU); also
the key of the ``NoSchedule`` taint that GPU node pools commonly carry."""

GPU_PRODUCTS: Final = MappingProxyType(
    {
        # catalog name → NVML device name with spaces as "-" (nvidia-smi --query-gpu=name)
        "a10g": "NVIDIA-A10G",
        "l4": "NVIDIA-L4",
        "l40s": "NVIDIA-L40S",
        "a100-40gb-pcie": "NVIDIA-A100-PCIE-40GB",
        "a100-40gb-sxm": "NVIDIA-A100-SXM4-40GB",
        "a100-80gb-pcie": "NVIDIA-A100-80GB-PCIe",
        "a100-80gb-sxm": "NVIDIA-A100-SXM4-80GB",
        "h100-pcie": "NVIDIA-H100-PCIe",
        "h100-nvl": "NVIDIA-H100-NVL",
        "h100-sxm": "NVIDIA-H100-80GB-HBM3",
        "h200": "NVIDIA-H200",
        "b200": "NVIDIA-B200",
    }
)
"""``nvidia.com/gpu.product`` per catalog GPU (``gpufleet catalog gpus``)."""


def gpu_product(gpu: str) -> str:
    """The ``nvidia.com/gpu.product`` value of a catalog GPU; ``ValueError`` if none is known."""
    try:
        return GPU_PRODUCTS[gpu]
    except KeyError:
        known = ", ".join(sorted(GPU_PRODUCTS))
        raise ValueError(
            f"gpu {gpu!r}: no Kubernetes node label known for it (NVIDIA GPUs only: {known})"
        ) from None
