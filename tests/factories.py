"""Spec factories for tests: shapes written out by hand, independent of the catalog files."""

from __future__ import annotations

from typing import Any

from gpufleet.catalog import GPUSpec, Interconnect, LinkKind, ModelSpec


def make_model(**overrides: Any) -> ModelSpec:
    """Llama-2-13B's shapes unless overridden (40 layers, 5120 hidden, MHA)."""
    fields: dict[str, Any] = {
        "name": "test-13b",
        "display_name": "Test 13B",
        "architecture": "llama",
        "num_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_kv_heads": 40,
        "head_dim": 128,
        "intermediate_size": 13824,
        "vocab_size": 32000,
        "max_context": 4096,
    }
    fields.update(overrides)
    return ModelSpec.model_validate(fields)


def make_70b() -> ModelSpec:
    """Llama-3.1-70B's shapes."""
    return make_model(
        name="test-70b",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_context=131072,
    )


def make_gpu(**overrides: Any) -> GPUSpec:
    """An 80 GiB NVLink GPU with H100-SXM-like figures unless overridden."""
    fields: dict[str, Any] = {
        "name": "test-gpu",
        "display_name": "Test GPU",
        "vendor": "nvidia",
        "memory_gib": 80.0,
        "memory_bandwidth_gb_s": 3350.0,
        "bf16_tflops": 989.0,
        "fp16_tflops": 989.0,
        "fp8_tflops": 1979.0,
        "int8_tops": 1979.0,
        "interconnect": Interconnect(kind=LinkKind.NVLINK, gpu_link_gb_s=900.0, pcie_gb_s=64.0),
        "tdp_watts": 700.0,
        "price_per_hour_usd": 3.0,
        "sources": {"all": "test fixture"},
    }
    fields.update(overrides)
    return GPUSpec.model_validate(fields)
