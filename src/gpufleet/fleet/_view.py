"""A frozen snapshot of the fleet: every replica, grouped into pools by model, at ``now``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpufleet.fleet._replica import IN_SERVICE, ROUTABLE, ReplicaId, ReplicaState, ReplicaView

_NO_REPLICAS: tuple[ReplicaView, ...] = ()


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet at ``now``: pools of replicas by model, each pool in a stable order.

    A view is a value: policies read it and never change it, and a shell builds a new one
    when something changes (a scrape, a health decision, a replica started or stopped).
    Build it with :meth:`of`; the order of the replicas given is the order policies see,
    so a seeded run sees the same order every time. Each pool's routable and in-service
    replicas are worked out once, when the view is built (a pool whose replicas are all
    routable is its own routable tuple: routers key caches on that identity).
    """

    now: float
    pools: Mapping[str, tuple[ReplicaView, ...]]
    _by_id: Mapping[ReplicaId, ReplicaView] = field(init=False, repr=False, compare=False)
    _routable: Mapping[str, tuple[ReplicaView, ...]] = field(init=False, repr=False, compare=False)
    _in_service: Mapping[str, tuple[ReplicaView, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        by_id: dict[ReplicaId, ReplicaView] = {}
        for model, replicas in self.pools.items():
            for replica in replicas:
                if replica.model != model:
                    raise ValueError(
                        f"replica {replica.id!r} serves {replica.model!r}, not pool {model!r}"
                    )
                if replica.id in by_id:
                    raise ValueError(f"replica {replica.id!r} appears twice in the view")
                by_id[replica.id] = replica
        object.__setattr__(self, "pools", MappingProxyType(dict(self.pools)))
        object.__setattr__(self, "_by_id", MappingProxyType(by_id))
        object.__setattr__(
            self, "_routable", {m: _subset(p, ROUTABLE) for m, p in self.pools.items()}
        )
        object.__setattr__(
            self, "_in_service", {m: _subset(p, IN_SERVICE) for m, p in self.pools.items()}
        )

    @classmethod
    def of(cls, now: float, replicas: Iterable[ReplicaView]) -> FleetView:
        """Group ``replicas`` into pools by model, keeping their order."""
        pools: dict[str, list[ReplicaView]] = {}
        for replica in replicas:
            pools.setdefault(replica.model, []).append(replica)
        return cls(now, {model: tuple(members) for model, members in pools.items()})

    def pool(self, model: str) -> tuple[ReplicaView, ...]:
        """The replicas serving ``model`` (empty for a model the fleet does not serve)."""
        return self.pools.get(model, _NO_REPLICAS)

    def routable(self, model: str) -> tuple[ReplicaView, ...]:
        """The pool's replicas that take new requests (``ROUTABLE``), in pool order."""
        return self._routable.get(model, _NO_REPLICAS)

    def in_service(self, model: str) -> tuple[ReplicaView, ...]:
        """The pool's capacity, healthy or not (``IN_SERVICE``), in pool order."""
        return self._in_service.get(model, _NO_REPLICAS)

    def replica(self, replica_id: ReplicaId) -> ReplicaView | None:
        return self._by_id.get(replica_id)

    def replicas(self) -> Iterator[ReplicaView]:
        """Every replica, pool by pool."""
        for members in self.pools.values():
            yield from members

    def __len__(self) -> int:
        return len(self._by_id)

    def with_states(self, states: Mapping[ReplicaId, ReplicaState], now: float) -> FleetView:
        """This view at ``now`` with the given replicas' states replaced (others unchanged)."""
        pools = {
            model: tuple(
                dataclasses.replace(r, state=states[r.id])
                if r.id in states and states[r.id] is not r.state
                else r
                for r in members
            )
            for model, members in self.pools.items()
        }
        return FleetView(now, pools)


def _subset(
    pool: tuple[ReplicaView, ...], states: frozenset[ReplicaState]
) -> tuple[ReplicaView, ...]:
    kept = tuple(r for r in pool if r.state in states)
    return pool if len(kept) == len(pool) else kept
