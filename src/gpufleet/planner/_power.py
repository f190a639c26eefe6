"""Power of GPUs and the hosts around them.

A GPU's TDP is only part of what its server draws: CPUs, memory, NICs, NVSwitches, fans and
power-supply losses come on top. We carry that as watts per GPU slot, by the kind of server:

* baseboard servers (SXM / OAM, NVLink or Infinity Fabric): NVIDIA's DGX H100 is rated at
  10.2 kW maximum for eight 700 W GPUs, so the host adds (10,200 − 5,600) / 8 = 575 W per GPU;
  DGX B200 (14.3 kW, eight 1,000 W GPUs) gives 538 W, so 575 W stands for the class;
* PCIe servers (L4, L40S, A10G, H100 PCIe): a dual-socket host of about 1.6 kW for eight
  cards, 200 W per slot.
"""

from __future__ import annotations

from gpufleet.catalog import GPUSpec

HOST_WATTS_PER_BASEBOARD_GPU = 575.0
HOST_WATTS_PER_PCIE_GPU = 200.0


def host_watts_per_gpu(gpu: GPUSpec) -> float:
    if gpu.interconnect.has_scale_up_link:
        return HOST_WATTS_PER_BASEBOARD_GPU
    return HOST_WATTS_PER_PCIE_GPU


def watts_per_gpu_slot(gpu: GPUSpec) -> float:
    """What one GPU and its share of the server draw at full load."""
    return gpu.tdp_watts + host_watts_per_gpu(gpu)
