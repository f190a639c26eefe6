"""Numeric formats of weights and KV cache, and their sizes."""

from __future__ import annotations

from enum import StrEnum


class Dtype(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bytes(self) -> float:
        """Bytes per element (int4 packs two to a byte; scales are counted separately)."""
        return _BYTES[self]


KV_DTYPES = frozenset({Dtype.BF16, Dtype.FP16, Dtype.FP8})

_BYTES: dict[Dtype, float] = {
    Dtype.FP32: 4.0,
    Dtype.BF16: 2.0,
    Dtype.FP16: 2.0,
    Dtype.FP8: 1.0,
    Dtype.INT8: 1.0,
    Dtype.INT4: 0.5,
}


def parse_dtype(text: str, *, kv: bool = False) -> Dtype:
    """Parse a dtype name; ``ValueError`` with the allowed names when it is not one."""
    allowed = sorted(KV_DTYPES if kv else set(Dtype))
    key = text.strip().lower()
    if key not in allowed:
        kind = "KV-cache dtype" if kv else "dtype"
        raise ValueError(f"unknown {kind} {text!r}; expected one of: {', '.join(allowed)}")
    return Dtype(key)
