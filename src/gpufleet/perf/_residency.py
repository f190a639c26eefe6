"""How long a replica takes to fall asleep, wake up and load its model (vLLM's sleep mode).

::

    t = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    t.wake(1)     # ≈ 0.37 s: 16 GB of bf16 weights back over PCIe Gen5 (64 GB/s × 0.7)
    t.wake(2)     # ≈ 4.4 s: the same 16 GB read from NVMe (4 GB/s), then copied up
    t.sleep(1)    # ≈ 0.37 s: the weights copied down to pinned host memory

A sleeping engine keeps its process (its CUDA context, the compiled graphs); what differs is
where its weights are:

* **level 1** offloads the weights to (pinned) host memory and drops the KV cache. Waking
  copies them back: ``weights per GPU / (PCIe one-way bandwidth × efficiency)`` (each GPU of
  a tensor-parallel replica copies its own shard over its own x16 link, in parallel).
  Falling asleep costs the same copy the other way.
* **level 2** drops both. Waking must read the checkpoint again — from the host's page cache
  or local NVMe (the seeds: "NVMe loads a 70B model in 30–60 s", ≈ 2.3–4.7 GB/s for 140 GB;
  we take 4 GB/s for the node) — then copy it up: ``weights of the replica / storage
  bandwidth + the level-1 copy``. Falling asleep is a free (``RELEASE_S``).

Waking also re-allocates the KV cache (``REALLOCATE_S``: a ``cudaMalloc`` of tens of GB and a
memset, tens of milliseconds). The efficiency of a pinned host↔device copy, 0.7 of the link's
nominal one-way rate, is what ``cudaMemcpyAsync`` from pinned memory reaches on PCIe Gen4 and
Gen5 x16 (~22 of 32, ~45 of 64 GB/s). These are modelled figures, not measurements of this
repository: docs/residency.md lists them beside vLLM's published ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf._dtype import Dtype
from gpufleet.perf._memory import Parallelism, memory_plan, weight_bytes

PINNED_COPY_EFFICIENCY: Final = 0.7
"""Share of the PCIe link's nominal one-way bandwidth a pinned host↔device copy reaches."""
STORAGE_GB_S: Final = 4.0
"""Read bandwidth of the node's checkpoint store (local NVMe) for a level-2 wake, GB/s."""
REALLOCATE_S: Final = 0.05
"""Re-allocating (and clearing) the KV cache on wake, seconds."""
RELEASE_S: Final = 0.05
"""Dropping weights and KV cache (level 2 sleep), or the KV cache alone, seconds."""


@dataclass(frozen=True, slots=True)
class ResidencyTimes:
    """Modelled seconds of each residency transition of one replica."""

    weights_per_gpu: int
    """Bytes of weights on the replica's most loaded GPU (what one PCIe link carries)."""
    weights: int
    """Bytes of the whole checkpoint (what a level-2 wake reads from storage)."""
    copy_s: float
    """Weights of one GPU over its PCIe link, one way."""
    read_s: float
    """The whole checkpoint read from storage."""

    def sleep(self, level: int) -> float:
        """Seconds ``POST /sleep?level=N`` takes."""
        _check(level)
        return RELEASE_S + (self.copy_s if level == 1 else 0.0)

    def wake(self, level: int) -> float:
        """Seconds ``POST /wake_up`` takes after a sleep of ``level``."""
        _check(level)
        load = self.copy_s if level == 1 else self.read_s + self.copy_s
        return REALLOCATE_S + load


def residency_times(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    parallel: Parallelism | None = None,
    weights_dtype: Dtype = Dtype.BF16,
    storage_gb_s: float = STORAGE_GB_S,
) -> ResidencyTimes:
    """The sleep and wake times of a replica of ``model`` on ``gpu`` (split by ``parallel``)."""
    if storage_gb_s <= 0:
        raise ValueError(f"storage_gb_s must be positive, got {storage_gb_s}")
    par = parallel or Parallelism()
    per_gpu = memory_plan(model, gpu, parallel=par, weights_dtype=weights_dtype).weights
    total = weight_bytes(model, weights_dtype)
    link = gpu.interconnect.pcie_gb_s * 1e9 * PINNED_COPY_EFFICIENCY
    return ResidencyTimes(
        weights_per_gpu=per_gpu,
        weights=total,
        copy_s=per_gpu / link,
        read_s=total / (storage_gb_s * 1e9),
    )


def _check(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
