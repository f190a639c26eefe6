"""Efficiency constants: how much of a GPU's datasheet peak a serving engine actually reaches.

The step-time model (``_step.py``) is a roofline over datasheet peaks; the constants here turn
peaks into what vLLM reaches on real hardware. They live in ``data/calibration.yaml``: one set
of defaults, per-GPU overrides, and beside every value the reason for it. Example::

    eff = efficiency_for(get_gpu("h100-sxm"))       # defaults merged with h100-sxm's overrides
    eff.memory_bandwidth_fraction                    # 0.85
    eff.link(LinkKind.NVLINK).allreduce_latency_s    # 8e-06
    faster = eff.replace(step_overhead_s=0.0005)     # what-if, for tests and sweeps

The file format, one entry per constant::

    defaults:
      gemm_flops_fraction: {value: 0.70, why: "cuBLAS reaches ~70 % of dense peak on big GEMMs"}
      links:
        nvlink:
          allreduce_latency_s: {value: 8.0e-6, why: "..."}
    gpus:
      a100-80gb-sxm:
        memory_bandwidth_fraction: {value: 0.80, why: "..."}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

from gpufleet.catalog import GPUSpec, LinkKind

CALIBRATION_FILE = "calibration.yaml"


class CalibrationError(ValueError):
    """The calibration file is malformed (unknown key, value out of range, missing reason)."""


@dataclass(frozen=True, slots=True)
class LinkEfficiency:
    """What a tensor-parallel all-reduce reaches on one kind of link.

    ``bandwidth_fraction`` is the share of the link's one-direction bandwidth that a large
    all-reduce moves (NCCL's "bus bandwidth" over the datasheet figure). ``allreduce_latency_s``
    is the fixed cost of one all-reduce, which is all that a small decode all-reduce pays.
    """

    bandwidth_fraction: float
    allreduce_latency_s: float

    def __post_init__(self) -> None:
        _check_fraction("bandwidth_fraction", self.bandwidth_fraction)
        _check_seconds("allreduce_latency_s", self.allreduce_latency_s)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Achievable fractions of peak and fixed costs, for one GPU type (see calibration.yaml)."""

    gemm_flops_fraction: float
    """Share of dense bf16/fp16 peak reached by the linear layers' GEMMs when compute-bound."""
    quantized_gemm_flops_fraction: float
    """Share of fp8/int8 peak reached by W8A8 GEMMs (scales and epilogues cost more)."""
    attention_flops_fraction: float
    """Share of dense 16-bit peak reached by the attention kernel (FlashAttention) on prefill."""
    memory_bandwidth_fraction: float
    """Share of HBM peak reached when streaming weights (GEMV-like decode GEMMs, elementwise)."""
    kv_bandwidth_fraction: float
    """Share of HBM peak the attention kernels reach when streaming the KV cache."""
    roofline_exponent: float
    """p of the smooth roofline ``(t_compute**p + t_memory**p)**(1/p)``; ``inf`` is a hard max."""
    step_overhead_s: float
    """CPU time per engine step that the GPU waits for: scheduling, input prep, sampling sync."""
    prefill_overhead_s: float
    """Extra per step that carries prefill tokens (not replayed from one full CUDA graph)."""
    sequence_overhead_s: float
    """Extra per sequence in the step (block tables, sampling, detokenisation)."""
    layer_overhead_s: float
    """GPU time per layer that does not shrink with batch or tp: small kernels and their gaps."""
    pipeline_transfer_latency_s: float
    """Fixed cost of handing activations from one pipeline stage to the next."""
    nvlink: LinkEfficiency
    infinity_fabric: LinkEfficiency
    pcie: LinkEfficiency

    def __post_init__(self) -> None:
        for name in (
            "gemm_flops_fraction",
            "quantized_gemm_flops_fraction",
            "attention_flops_fraction",
            "memory_bandwidth_fraction",
            "kv_bandwidth_fraction",
        ):
            _check_fraction(name, getattr(self, name))
        if not self.roofline_exponent >= 1.0:
            raise CalibrationError(
                f"roofline_exponent must be at least 1 (inf for a hard roofline), "
                f"got {self.roofline_exponent}"
            )
        for name in (
            "step_overhead_s",
            "prefill_overhead_s",
            "sequence_overhead_s",
            "layer_overhead_s",
            "pipeline_transfer_latency_s",
        ):
            _check_seconds(name, getattr(self, name))

    def link(self, kind: LinkKind) -> LinkEfficiency:
        """The all-reduce efficiency of ``kind``."""
        if kind is LinkKind.NVLINK:
            return self.nvlink
        if kind is LinkKind.INFINITY_FABRIC:
            return self.infinity_fabric
        return self.pcie

    def replace(self, **changes: Any) -> Efficiency:
        """A copy with some constants changed (validated like the file's)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Calibration:
    """The parsed calibration file: defaults, per-GPU overrides, and every value's reason."""

    defaults: Efficiency
    overrides: Mapping[str, Mapping[str, float]]
    reasons: Mapping[str, str]
    """``"defaults.gemm_flops_fraction"`` or ``"gpus.h100-sxm.links.nvlink.…"`` → why."""

    def for_gpu(self, gpu_name: str) -> Efficiency:
        """Defaults with ``gpu_name``'s overrides applied (defaults alone for other GPUs)."""
        return _apply(self.defaults, self.overrides.get(gpu_name, {}))


def efficiency_for(gpu: GPUSpec | str) -> Efficiency:
    """The packaged calibration's constants for ``gpu`` (a spec or a catalog name)."""
    name = gpu if isinstance(gpu, str) else gpu.name
    return load_calibration().for_gpu(name)


@cache
def load_calibration() -> Calibration:
    """Parse the packaged ``data/calibration.yaml`` (once per process; it is immutable)."""
    text = resources.files("gpufleet.perf").joinpath("data", CALIBRATION_FILE).read_text("utf-8")
    return parse_calibration(yaml.safe_load(text), source=CALIBRATION_FILE)


def parse_calibration(doc: object, *, source: str = "<calibration>") -> Calibration:
    """Validate a calibration document (as ``yaml.safe_load`` returns it)."""
    if not isinstance(doc, dict) or set(doc) - {"defaults", "gpus"} or "defaults" not in doc:
        raise CalibrationError(f"{source}: expected a mapping with 'defaults' and optional 'gpus'")
    reasons: dict[str, str] = {}
    flat_defaults = _flatten(doc["defaults"], f"{source}: defaults", "defaults", reasons)
    missing = _ALL_KEYS - set(flat_defaults)
    if missing:
        raise CalibrationError(f"{source}: defaults lack {', '.join(sorted(missing))}")
    defaults = _build(flat_defaults, f"{source}: defaults")
    overrides: dict[str, dict[str, float]] = {}
    gpus = doc.get("gpus") or {}
    if not isinstance(gpus, dict):
        raise CalibrationError(f"{source}: 'gpus' must map GPU names to overrides")
    for gpu_name, entry in gpus.items():
        where = f"{source}: gpus.{gpu_name}"
        flat = _flatten(entry, where, f"gpus.{gpu_name}", reasons)
        _apply(defaults, flat, where)  # validates the merged constants now, not at first use
        overrides[str(gpu_name)] = flat
    return Calibration(defaults=defaults, overrides=overrides, reasons=reasons)


_SCALAR_KEYS = frozenset(
    f.name
    for f in dataclasses.fields(Efficiency)
    if f.name not in {"nvlink", "infinity_fabric", "pcie"}
)
_LINK_NAMES = {"nvlink": "nvlink", "infinity-fabric": "infinity_fabric", "pcie": "pcie"}
_LINK_KEYS = frozenset(f.name for f in dataclasses.fields(LinkEfficiency))
_ALL_KEYS = _SCALAR_KEYS | {f"links.{k}.{f}" for k in _LINK_NAMES for f in _LINK_KEYS}


def _flatten(entry: object, where: str, prefix: str, reasons: dict[str, str]) -> dict[str, float]:
    """``{key: {value, why}}`` (with a nested ``links`` table) → ``{"a.b": value}``."""
    if not isinstance(entry, dict):
        raise CalibrationError(f"{where}: expected a mapping of constants")
    flat: dict[str, float] = {}
    for key, item in entry.items():
        if key == "links":
            if not isinstance(item, dict) or set(item) - set(_LINK_NAMES):
                raise CalibrationError(
                    f"{where}: 'links' must map some of {', '.join(_LINK_NAMES)} to constants"
                )
            for link, consts in item.items():
                inner = _flatten(consts, f"{where}.links.{link}", f"{prefix}.links.{link}", reasons)
                unknown = set(inner) - _LINK_KEYS
                if unknown:
                    raise CalibrationError(
                        f"{where}.links.{link}: unknown constant {', '.join(sorted(unknown))}"
                    )
                flat.update({f"links.{link}.{k}": v for k, v in inner.items()})
            continue
        if prefix.count(".links.") == 0 and key not in _SCALAR_KEYS:
            raise CalibrationError(
                f"{where}: unknown constant {key!r}; known: {', '.join(sorted(_SCALAR_KEYS))}"
            )
        if not isinstance(item, dict) or set(item) != {"value", "why"}:
            raise CalibrationError(f"{where}.{key}: expected {{value: <number>, why: <reason>}}")
        value, why = item["value"], item["why"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalibrationError(f"{where}.{key}: value must be a number, got {value!r}")
        if not isinstance(why, str) or not why.strip():
            raise CalibrationError(f"{where}.{key}: every constant needs a non-empty 'why'")
        flat[str(key)] = float(value)
        reasons[f"{prefix}.{key}"] = why.strip()
    return flat


def _build(flat: Mapping[str, float], where: str) -> Efficiency:
    try:
        fields: dict[str, Any] = {k: flat[k] for k in _SCALAR_KEYS}
        for name, attr in _LINK_NAMES.items():
            fields[attr] = LinkEfficiency(**{f: flat[f"links.{name}.{f}"] for f in _LINK_KEYS})
        return Efficiency(**fields)
    except CalibrationError as exc:
        raise CalibrationError(f"{where}: {exc}") from None


def _apply(base: Efficiency, flat: Mapping[str, float], where: str = "override") -> Efficiency:
    if not flat:
        return base
    merged: dict[str, float] = {k: getattr(base, k) for k in _SCALAR_KEYS}
    for name, attr in _LINK_NAMES.items():
        link = getattr(base, attr)
        merged.update({f"links.{name}.{f}": getattr(link, f) for f in _LINK_KEYS})
    merged.update(flat)
    return _build(merged, where)


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise CalibrationError(f"{name} must be in (0, 1], got {value}")


def _check_seconds(name: str, value: float) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise CalibrationError(f"{name} must be a finite number of seconds >= 0, got {value}")
