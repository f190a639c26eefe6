"""Where a spot pool's replicas run when the provider takes them: the fallback rule.

One object per pool (:class:`SpotCapacity`), held by its pool controller, pure::

    Reclaimed(r) ─► spot GPUs to be had?  ─► Replace(r, spot)
                    none; fallback on_demand ─► Replace(r, on_demand)  (r stands in)
                    none; fallback wait   ─► r waits
    SpotMarket(available) ─► each waiting r, and each stand-in ─► Replace(r, spot)
    Scale (an autoscaler's decision) ─► its new replicas' capacity (``Scale.buy``): the
                    pool's; on demand while spot GPUs are short (on_demand); none (wait)

An on-demand pool's reclaimed replica (a node drained for maintenance) is replaced on
on-demand GPUs. The stand-in keeps serving while its spot node starts; the runtime moves it
once that node serves, so moving back costs no capacity (docs/spot.md).
"""

from __future__ import annotations

from gpufleet.config import Capacity, SpotFallback
from gpufleet.control._spot_events import Replace
from gpufleet.fleet import ReplicaId

NO_BUY = "none"
"""``Scale.buy`` when no replica can be bought: its starts wait for a later decision."""


class SpotCapacity:
    """One pool's spot market as last heard, and each replica's capacity."""

    __slots__ = ("available", "capacity", "fallback", "model", "on", "waiting")

    def __init__(self, model: str, capacity: Capacity, fallback: SpotFallback) -> None:
        self.model = model
        self.capacity = capacity
        self.fallback = fallback
        self.available = True
        """Whether spot GPUs can be had (``SpotMarket``; assumed until told otherwise)."""
        self.on: dict[ReplicaId, Capacity] = {}
        """Replicas not on the pool's own capacity: the on-demand stand-ins."""
        self.waiting: list[ReplicaId] = []
        """Reclaimed replicas waiting for spot GPUs (``fallback: wait``), oldest first."""

    def reclaimed(self, replica: ReplicaId) -> list[Replace]:
        """``replica``'s GPUs are gone: its replacement's capacity, or none yet."""
        self.on.pop(replica, None)
        if self.capacity is not Capacity.SPOT or self.available:
            return [Replace(self.model, replica, self.capacity)]
        if self.fallback is SpotFallback.ON_DEMAND:
            self.on[replica] = Capacity.ON_DEMAND
            return [Replace(self.model, replica, Capacity.ON_DEMAND)]
        if replica not in self.waiting:
            self.waiting.append(replica)
        return []

    def market(self, available: bool) -> list[Replace]:
        """Spot GPUs came back (or went): the waiting replicas and the stand-ins get them."""
        if self.capacity is not Capacity.SPOT or available == self.available:
            self.available = available
            return []
        self.available = available
        if not available:
            return []  # the spot replicas running keep running until they are reclaimed
        back = [*self.waiting, *self.on]
        self.waiting.clear()
        self.on.clear()
        return [Replace(self.model, replica, Capacity.SPOT) for replica in back]

    def buy(self) -> str:
        """What a replica the autoscaler adds is bought as now (``Scale.buy``): ``""`` the
        pool's capacity; ``on_demand`` while spot GPUs are short (``fallback: on_demand``;
        it stays on demand until scaled in); ``none`` (``wait``)."""
        if self.capacity is not Capacity.SPOT or self.available:
            return ""
        return Capacity.ON_DEMAND.value if self.fallback is SpotFallback.ON_DEMAND else NO_BUY

    def forget(self, replica: ReplicaId) -> None:
        """``replica`` left the pool (scaled in): nothing to replace."""
        self.on.pop(replica, None)
        if replica in self.waiting:
            self.waiting.remove(replica)
