"""GPU specifications.

Every figure is per GPU, for dense math (no 2:4 sparsity), in decimal units (GB/s, TFLOP/s)
except memory capacity, which is GiB as CUDA reports it: that is what a KV budget is cut from.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat


class LinkKind(StrEnum):
    """How the GPUs of one node talk to each other."""

    NVLINK = "nvlink"
    INFINITY_FABRIC = "infinity-fabric"
    PCIE = "pcie"


class Interconnect(BaseModel):
    """Links of one GPU.

    ``gpu_link_gb_s`` is the total bidirectional bandwidth of the GPU's scale-up links (NVLink,
    Infinity Fabric), ``None`` for PCIe-only cards. ``pcie_gb_s`` is one direction of its x16 slot.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: LinkKind
    gpu_link_gb_s: PositiveFloat | None = None
    pcie_gb_s: PositiveFloat

    @property
    def has_scale_up_link(self) -> bool:
        return self.kind is not LinkKind.PCIE and self.gpu_link_gb_s is not None


class GPUSpec(BaseModel):
    """One GPU type, as the catalog's ``gpus.yaml`` describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    display_name: str
    vendor: str
    memory_gib: PositiveFloat
    memory_bandwidth_gb_s: PositiveFloat
    bf16_tflops: PositiveFloat
    fp16_tflops: PositiveFloat
    fp8_tflops: PositiveFloat | None = None
    int8_tops: PositiveFloat | None = None
    interconnect: Interconnect
    tdp_watts: PositiveFloat
    idle_watts: PositiveFloat | None = None
    """Draw with the engine up and no work (P0, a CUDA context open), where measured; ``None``
    where the catalog has no measurement."""
    price_per_hour_usd: PositiveFloat
    sources: dict[str, str] = Field(min_length=1)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def with_price(self, price_per_hour_usd: float) -> GPUSpec:
        """The same GPU at another hourly price (the catalog's price is only typical)."""
        return self.model_copy(update={"price_per_hour_usd": price_per_hour_usd})
