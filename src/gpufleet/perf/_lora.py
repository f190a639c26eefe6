"""How big a LoRA adapter is, and how long an engine takes to load one.

::

    t = lora_load_seconds(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), rank=8)
    # ≈ 0.104 s: 13.6 MB of bf16 A/B matrices (q, k, v, o of 32 layers) read from NVMe
    # and copied to the GPU, after the fixed cost of registering an adapter

An adapter of rank ``r`` on a linear layer ``d_in → d_out`` adds two matrices, ``A`` (``r ×
d_in``) and ``B`` (``d_out × r``): ``r · (d_in + d_out)`` parameters. Fine-tunes most often
adapt the attention projections (``q``, ``k``, ``v``, ``o``); ``ATTENTION`` is the default
and ``ALL_LINEAR`` adds the MLP's gate, up and down projections. The bytes are small (tens of
MB for an 8B model), so a load is dominated by its fixed cost: vLLM's
``/v1/load_lora_adapter`` reads the adapter's config and safetensors, builds its tensors and
places them in the adapter slots; ``LOAD_OVERHEAD_S`` stands for that, a modelled figure (no
GPU measurement of it is in this repository: docs/residency.md, "LoRA adapters").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf._residency import PINNED_COPY_EFFICIENCY, STORAGE_GB_S

LOAD_OVERHEAD_S: Final = 0.1
"""Fixed seconds of an adapter load (config, tensor construction, slot placement)."""
UNLOAD_S: Final = 0.005
"""Seconds to unload an adapter (its slot is freed; nothing is copied)."""
ATTENTION: Final = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR: Final = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
ADAPTER_BYTES_PER_PARAM: Final = 2
"""bf16 adapter weights."""


def _shapes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of each linear layer an adapter may target, per decoder layer."""
    h, q, kv = model.hidden_size, model.q_dim, model.num_kv_heads * model.head_dim
    ffn = model.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }


def lora_bytes(model: ModelSpec, rank: int, targets: Iterable[str] = ATTENTION) -> int:
    """Bytes of a rank-``rank`` adapter of ``model`` on the ``targets`` projections."""
    if rank < 1:
        raise ValueError(f"a LoRA rank is at least 1, got {rank}")
    shapes = _shapes(model)
    params = 0
    for target in targets:
        if target not in shapes:
            raise ValueError(f"not a LoRA target: {target!r} (one of {', '.join(shapes)})")
        d_in, d_out = shapes[target]
        params += rank * (d_in + d_out)
    return params * model.num_layers * ADAPTER_BYTES_PER_PARAM


def lora_load_seconds(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    rank: int,
    targets: Iterable[str] = ATTENTION,
    storage_gb_s: float = STORAGE_GB_S,
) -> float:
    """Seconds a replica of ``model`` on ``gpu`` takes to load a rank-``rank`` adapter: the
    fixed cost, the bytes read from storage, then copied over PCIe."""
    size = lora_bytes(model, rank, targets)
    link = gpu.interconnect.pcie_gb_s * 1e9 * PINNED_COPY_EFFICIENCY
    return LOAD_OVERHEAD_S + size / (storage_gb_s * 1e9) + size / link
