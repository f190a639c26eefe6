"""Where the gateway learns which replicas exist: a small protocol the shell feeds.

The gateway does not know who runs the replicas. ``gpufleet up`` adapts the local runtime's
snapshots into :class:`Upstream` lists; tests pass :class:`StaticReplicas`::

    source.subscribe(listener)   # listener(replicas) now and on every change → unsubscribe()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.fleet import ReplicaId, ReplicaState

Listener = Callable[[Sequence["Upstream"]], None]


@dataclass(frozen=True, slots=True)
class Upstream:
    """One replica as its owner reports it: name, served model, base URL, runtime state."""

    name: ReplicaId
    model: str
    """The served model name (what clients send as ``model``)."""
    url: str | None
    """Base URL without ``/v1``; ``None`` while it has no process."""
    state: ReplicaState = ReplicaState.READY
    kv_events: str | None = None
    """The ZMQ endpoint its engine publishes KV events on (``None``: none; docs/kv-events.md)."""
    kv_replay: str | None = None
    """The engine's KV-event replay endpoint (``None``: none)."""
    reclaim_at: float | None = None
    """When the provider takes it back, on the wall clock (Unix seconds): a preemption
    notice its owner saw (a node's taint); ``None``: none."""


class ReplicaSource(Protocol):
    """Anything with ``subscribe(listener) -> unsubscribe``: a runtime adapter, a fixed list."""

    def subscribe(self, listener: Listener) -> Callable[[], None]: ...


class StaticReplicas(ReplicaSource):
    """A fixed list of replicas that can be replaced by hand (``update``): tests, external."""

    def __init__(self, replicas: Sequence[Upstream]) -> None:
        self._replicas = tuple(replicas)
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        listener(self._replicas)
        return lambda: self._listeners.remove(listener)

    def update(self, replicas: Sequence[Upstream]) -> None:
        self._replicas = tuple(replicas)
        for listener in list(self._listeners):
            listener(self._replicas)
