"""The modelled engines' LoRA adapter loads: when a load a Route asks for is done.

The controller decides where each adapter goes and what a load evicts
(``gpufleet.control``'s adapter placement); the simulator only carries that out. A Route
with ``load`` makes its replica busy loading that adapter for
``gpufleet.perf.lora_load_seconds`` (its pool's model and GPU, the adapter's rank); the
request reaches the engine when the load is done, and so does every other request for that
adapter sent there before then (the shell's one load, shared). An UnloadAdapter is counted
(it frees a slot at once: vLLM's unload copies nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.catalog import get_gpu, get_model
from gpufleet.config import FleetConfig
from gpufleet.fleet import ReplicaId
from gpufleet.perf import lora_load_seconds


@dataclass(slots=True)
class AdapterStats:
    """What the modelled engines did with adapters, fleet-wide."""

    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    """Modelled seconds of every load carried out."""
    waited: int = 0
    """Attempts that reached their engine later for a load (theirs, or one under way)."""
    wait_seconds: float = 0.0
    """What those attempts waited, in all."""


class SimAdapters:
    """Adapter loads under way per replica, and each adapter's modelled load time."""

    __slots__ = ("_ready", "_seconds", "stats")

    def __init__(self, fleet: FleetConfig) -> None:
        self._seconds: dict[str, float] = {}
        for m in fleet.models:
            if m.lora is None:
                continue
            spec, gpu = get_model(m.served_model), get_gpu(m.gpu)
            for a in m.lora.adapters:
                self._seconds[a.name] = lora_load_seconds(spec, gpu, rank=a.rank)
        self._ready: dict[tuple[ReplicaId, str], float] = {}
        self.stats = AdapterStats()

    @staticmethod
    def of(fleet: FleetConfig) -> SimAdapters | None:
        """``None`` for a fleet that serves no adapter (nothing is added to a Route's path)."""
        return SimAdapters(fleet) if any(m.lora is not None for m in fleet.models) else None

    def load_seconds(self, adapter: str) -> float:
        return self._seconds[adapter]

    def ready_at(self, now: float, replica: ReplicaId, adapter: str, load: bool) -> float:
        """When an attempt for ``adapter`` sent to ``replica`` at ``now`` reaches its engine
        (``load``: its Route loads the adapter first)."""
        key = (replica, adapter)
        if load:
            took = self._seconds[adapter]
            ready = now + took
            self._ready[key] = ready
            self.stats.loads += 1
            self.stats.load_seconds += took
        else:
            ready = max(now, self._ready.get(key, now))
        if ready > now:
            self.stats.waited += 1
            self.stats.wait_seconds += ready - now
        return ready

    def unload(self, replica: ReplicaId, adapter: str) -> None:
        self._ready.pop((replica, adapter), None)
        self.stats.unloads += 1
