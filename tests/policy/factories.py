"""Fleet views and requests for policy tests, written out by hand."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpufleet.fleet import (
    FleetView,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    RouteRequest,
)

READY = ReplicaState.READY
MODEL = "m"


def rid(i: int) -> ReplicaId:
    return ReplicaId(f"r{i}")


def make_view(
    states: Sequence[ReplicaState] | int,
    now: float = 0.0,
    model: str = MODEL,
    loads: Sequence[ReplicaLoad] | None = None,
    extra: Iterable[ReplicaView] = (),
) -> FleetView:
    """One pool of replicas ``r0 … r(n-1)`` in the given states (all READY for an int)."""
    if isinstance(states, int):
        states = [READY] * states
    loads = loads or [ReplicaLoad()] * len(states)
    replicas = [
        ReplicaView(rid(i), model, state, load)
        for i, (state, load) in enumerate(zip(states, loads, strict=True))
    ]
    return FleetView.of(now, [*replicas, *extra])


def make_request(
    n: int = 0,
    prefix: Sequence[int] = (),
    tokens: int = 100,
    session: str | None = None,
    model: str = MODEL,
) -> RouteRequest:
    return RouteRequest(f"q{n}", model, tuple(prefix), tokens, session)


def scraped(
    running: int = 0, waiting: int = 0, kv: float = 0.0, at: float = 0.0, in_flight: int = 0
) -> ReplicaLoad:
    return ReplicaLoad(in_flight, running, waiting, kv, at)
