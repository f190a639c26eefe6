"""A pool's LoRA adapters on its replicas: what each holds, and what each request uses.

::

    adapters = PoolAdapters(lora_config)
    replica = adapters.place(now, "sql", ranking, attempts)   # the policy's choice
    load, evict = adapters.start(now, replica, "sql")          # a Route's ``load``; Unloads
    adapters.end(replica, "sql")                               # its attempt ended
    adapters.forget(replica)                                   # a new process holds none

The controller's own account of the engines' adapters: an adapter is held from the moment
the controller sends the Route that loads it (a second request for it waits in the shell
for that load, not for another), until an UnloadAdapter, or the replica's process is gone
or new. The rule of where to go and what to evict is ``gpufleet.policy.place_adapter``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpufleet.fleet import ReplicaId
from gpufleet.policy import DemandMeter, LoraConfig, Placement, load_on, place_adapter


@dataclass(slots=True)
class AdapterCounters:
    """What adapter placement did (both shells report these)."""

    requests: int = 0
    """Attempts of requests for an adapter (retries and resumes included)."""
    loads: int = 0
    """Attempts that loaded their adapter first (a miss)."""
    unloads: int = 0
    over_cap: int = 0
    """Loads onto a replica whose every slot was busy (it held one more than ``max_loras``):
    a retry's or a resume's, which go where they are sent."""
    waits: int = 0
    """Requests held until a slot freed (no replica held their adapter, every slot busy)."""


class PoolAdapters:
    """One pool's adapters per replica, least recently used first, with attempts in flight."""

    __slots__ = ("_held", "_meters", "config", "counters", "registered")

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.counters = AdapterCounters()
        self.registered: dict[str, str] = {a.name: a.path for a in config.adapters}
        """Every adapter the pool serves and where its engines load it from: the fleet
        file's, then those registered at run time (``AdapterAdded``)."""
        self._held: dict[ReplicaId, dict[str, int]] = {}
        self._meters: dict[str, DemandMeter] = {}

    def held(self) -> dict[ReplicaId, tuple[str, ...]]:
        """Each replica's adapters, least recently used first (metrics, reports, tests)."""
        return {r: tuple(held) for r, held in self._held.items() if held}

    def arrived(self, now: float, adapter: str) -> None:
        meter = self._meters.get(adapter)
        if meter is None:
            meter = self._meters[adapter] = DemandMeter()
        meter.arrive(now)

    def _value(self, now: float) -> _Value:
        return _Value(now, self._meters, self._held)

    def place(
        self, now: float, adapter: str, order: Sequence[ReplicaId], busy: Mapping[ReplicaId, int]
    ) -> Placement | None:
        """Where a request for ``adapter`` goes among ``order`` (reachable replicas, the
        router's best first)."""
        return place_adapter(
            adapter, order, self._held, busy, value=self._value(now), config=self.config
        )

    def start(self, now: float, replica: ReplicaId, adapter: str) -> tuple[bool, list[str]]:
        """An attempt for ``adapter`` starts on ``replica``: whether it loads the adapter
        first, and the adapters it unloads to make room (one for a full replica; more for
        one left over its cap by earlier loads whose adapters are idle now)."""
        counters = self.counters
        counters.requests += 1
        held = self._held.get(replica)
        if held is None:
            held = self._held[replica] = {}
        n = held.pop(adapter, None)
        if n is not None:
            held[adapter] = n + 1  # now the most recently used
            return False, []
        evicted: list[str] = []
        value = self._value(now)
        while len(held) >= self.config.max_loras:
            placed = load_on(replica, adapter, held, value, self.config, force=False)
            if placed is None or placed.evict is None:  # every one busy: over the cap
                counters.over_cap += 1
                break
            del held[placed.evict]
            evicted.append(placed.evict)
        counters.unloads += len(evicted)
        held[adapter] = 1
        counters.loads += 1
        return True, evicted

    def end(self, replica: ReplicaId, adapter: str) -> None:
        """An attempt for ``adapter`` on ``replica`` ended."""
        held = self._held.get(replica)
        if held is not None and adapter in held:
            held[adapter] -= 1

    def forget_adapter(self, replica: ReplicaId, adapter: str) -> None:
        """The attempt that loaded ``adapter`` on ``replica`` failed before its first byte
        (the load itself, maybe): it is not counted as held there; a later request loads it
        again (an engine that has it answers that load as done)."""
        held = self._held.get(replica)
        if held is not None:
            held.pop(adapter, None)

    def forget(self, replica: ReplicaId) -> None:
        """``replica``'s process is gone, or a new one started: it holds no adapter."""
        self._held.pop(replica, None)


class _Value:
    """What keeping an adapter is worth: its decayed request rate per replica holding it."""

    __slots__ = ("_held", "_meters", "_now")

    def __init__(
        self,
        now: float,
        meters: Mapping[str, DemandMeter],
        held: Mapping[ReplicaId, dict[str, int]],
    ) -> None:
        self._now, self._meters, self._held = now, meters, held

    def __call__(self, adapter: str) -> float:
        meter = self._meters.get(adapter)
        if meter is None:
            return 0.0
        copies = sum(1 for held in self._held.values() if adapter in held)
        return meter.rate(self._now) / max(copies, 1)
