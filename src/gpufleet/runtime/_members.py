"""Which replicas of a pool are wanted, and in which role: serving or standing by.

The autoscaler decides *which* replica leaves (the least loaded, not the highest index), and
keeps a few prewarmed standbys (process started, model loaded, not routed) that join the
serving set without a restart. So a pool's wanted replicas are two sets of indices, not a
count::

    members = PoolMembers()
    members.scale(3, remove=(), taken={0, 1})   # serving {0, 1, 2}: 2 is the lowest free index
    members.scale(2, remove=(1,), taken=...)    # serving {0, 2}: the one named leaves
    members.promote((5,))                       # standby 5 serves now (same process)

A new replica takes the lowest index that no wanted *or still running* replica has (``taken``:
the runtime's records, draining ones included), so names stay small and deterministic and a
new replica never reuses the name of one that is still draining. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass, field


@dataclass(slots=True)
class PoolMembers:
    """The serving and standby indices of one pool, and the standby target."""

    serving: set[int] = field(default_factory=set)
    standby: set[int] = field(default_factory=set)
    standby_target: int = 0

    @classmethod
    def first(cls, count: int, standby: int = 0) -> PoolMembers:
        """A new pool: serving ``0 .. count-1``, standbys after them."""
        return cls(set(range(count)), set(range(count, count + standby)), standby)

    def wanted(self) -> list[int]:
        """Every index that should have a process, in index order."""
        return sorted(self.serving | self.standby)

    def scale(self, count: int, remove: Iterable[int], taken: Set[int]) -> None:
        """Serve ``count`` replicas: drop the ``remove``d ones (indices not serving are
        ignored, so a repeated call is harmless), then the highest indices while above
        ``count``; add the lowest free indices while below."""
        if count < 0:
            raise ValueError(f"replica count must be >= 0, got {count}")
        self.serving -= set(remove)
        while len(self.serving) > count:
            self.serving.remove(max(self.serving))
        while len(self.serving) < count:
            self.serving.add(self._free(taken))

    def promote(self, indices: Iterable[int]) -> list[int]:
        """Move these standbys into service (others are ignored); the ones moved."""
        moved = sorted(i for i in set(indices) if i in self.standby)
        self.standby -= set(moved)
        self.serving |= set(moved)
        return moved

    def refill(self, taken: Set[int], prefer_removing: Iterable[int] = ()) -> None:
        """Bring the standbys to ``standby_target``: add the lowest free indices, or retire
        the extra ones (``prefer_removing`` first, e.g. those still warming, then the
        highest)."""
        order = [i for i in prefer_removing if i in self.standby]
        while len(self.standby) > self.standby_target:
            victim = order.pop(0) if order else max(self.standby)
            self.standby.discard(victim)
        while len(self.standby) < self.standby_target:
            self.standby.add(self._free(taken))

    def _free(self, taken: Set[int]) -> int:
        index = 0
        while index in self.serving or index in self.standby or index in taken:
            index += 1
        return index
