"""The fleet file's residency rules across pools: which pools may share GPU slots.

Pools that name the same ``residency.slots`` share GPUs: replica ``i`` of each sits on slot
``i`` (docs/residency.md). So they must have the same replica count, GPU and ``tp``, a fixed
count (no ``autoscale``: a slot is a place, not a number), and engines this fleet starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpufleet.policy import ResidencyConfig

DEFAULT_MEMORY = 0.9
"""An engine's ``gpu_memory_utilization`` when the fleet file sets none (vLLM's)."""


class _Model(Protocol):
    """What the check reads of a ``ModelConfig`` (no import cycle with ``_fleet``)."""

    @property
    def name(self) -> str: ...
    @property
    def gpu(self) -> str: ...
    @property
    def tp(self) -> int: ...
    @property
    def residency(self) -> ResidencyConfig: ...
    @property
    def replica_count(self) -> int: ...


def check_slots(models: Sequence[_Model]) -> None:
    """``ValueError`` unless the pools of each ``slots`` name can share GPU slots."""
    groups: dict[str, list[_Model]] = {}
    for m in models:
        if m.residency.slots is not None:
            groups.setdefault(m.residency.slots, []).append(m)
    for name, members in groups.items():
        first = members[0]
        for m in members[1:]:
            for what in ("replica_count", "gpu", "tp"):
                if getattr(m, what) != getattr(first, what):
                    raise ValueError(
                        f"residency.slots {name!r}: {m.name!r} and {first.name!r} share GPU "
                        f"slots but differ in {what.replace('_count', 's')} "
                        f"({getattr(m, what)} vs {getattr(first, what)})"
                    )
