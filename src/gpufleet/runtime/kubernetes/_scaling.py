"""Scaling a pool's Deployment: a pure, level-triggered plan from desired and observed state.

``plan_pool(pool, desired, observed)`` looks at what is wanted (a replica count and, for a
scale-down, the pods the autoscaler chose to remove) and at what is (the Deployment's
``spec.replicas``, the pool's pods from its EndpointSlices, which victims are drained and
marked) and returns the pods to keep out of routing and the next actions. Called again with
the same facts it returns the same answer, so the shell can call it on every change and on a
timer, and a lost reply or a restart costs nothing but a repeated, idempotent call.

A scale-down from ``n`` to ``n - k`` goes::

    Drain(pod)        the gateway stops routing to it; wait for its in-flight requests
    Mark(pod)         controller.kubernetes.io/pod-deletion-cost: "-1000" on the pod
    PatchScale(n-k)   the ReplicaSet deletes the pod with the lowest cost: the marked one

The ReplicaSet ranks pods before it looks at the deletion cost: unscheduled before scheduled,
pending before running, not ready before ready. So pods without an endpoint yet (pending) and
pods that are not ready are removed first, and they carry no traffic: they need no drain and
no mark. Victims are picked in that order, then the autoscaler's choice, then by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpufleet.runtime.kubernetes._endpoints import PodEndpoint, PodState

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DELETION_COST = "-1000"
"""Lower than any pod's default (0): the ReplicaSet removes a marked pod first."""


@dataclass(frozen=True, slots=True)
class Desired:
    """What the autoscaler asked for: a count, and for a scale-down the pods to remove."""

    count: int
    remove: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


@dataclass(frozen=True, slots=True)
class Observed:
    """What the shell knows of one pool."""

    scale: int | None
    """The Deployment's ``spec.replicas``; ``None`` until it has been read."""
    pods: tuple[PodEndpoint, ...] = ()
    drained: frozenset[str] = field(default_factory=frozenset)
    """Victims with no request left in flight (or whose drain deadline passed)."""
    marked: frozenset[str] = field(default_factory=frozenset)
    """Victims that carry the deletion-cost annotation."""
    retired: frozenset[str] = field(default_factory=frozenset)
    """Victims of a scale patch that succeeded: the ReplicaSet is about to delete them."""


@dataclass(frozen=True, slots=True)
class Drain:
    pool: str
    pod: str
    url: str


@dataclass(frozen=True, slots=True)
class Mark:
    pool: str
    pod: str


@dataclass(frozen=True, slots=True)
class PatchScale:
    pool: str
    replicas: int
    retire: tuple[str, ...] = ()
    """The victims this patch removes (kept out of routing until they are gone)."""


Action = Drain | Mark | PatchScale


@dataclass(frozen=True, slots=True)
class PoolPlan:
    draining: frozenset[str]
    """Pods the gateway must not route to: victims being drained, marked or retired."""
    actions: tuple[Action, ...]


def plan_pool(pool: str, desired: Desired | None, observed: Observed) -> PoolPlan:
    """The pool's draining pods and next actions (see the module docstring)."""
    live = {p.name: p for p in observed.pods if p.state is not PodState.TERMINATING}
    scale = observed.scale
    if scale is None:  # nothing is known yet: keep retired pods out, change nothing
        return PoolPlan(frozenset(observed.retired & live.keys()), ())
    # a retired pod is on its way out while the ReplicaSet still has more live pods than it
    # wants; once it has as many as it wants, a retired pod that is still live was spared
    # (the ReplicaSet removed a pending or unready pod instead) and serves again
    retiring = frozenset(observed.retired & live.keys()) if len(live) > scale else frozenset()
    if desired is None or desired.count >= scale:
        patch = (
            () if desired is None or desired.count == scale else (PatchScale(pool, desired.count),)
        )
        return PoolPlan(retiring, patch)
    candidates = {name: pod for name, pod in live.items() if name not in retiring}
    unseen = max(0, scale - len(candidates))  # pods without an endpoint: removed first
    wanted = scale - desired.count - unseen
    if wanted <= 0:
        return PoolPlan(retiring, (PatchScale(pool, desired.count),))
    victims = _victims(candidates, desired.remove, wanted)
    ready = [v for v in victims if candidates[v].state is PodState.READY]
    draining = retiring | frozenset(victims)
    undrained = [v for v in ready if v not in observed.drained]
    if undrained:
        return PoolPlan(draining, tuple(Drain(pool, v, candidates[v].url) for v in undrained))
    unmarked = [v for v in ready if v not in observed.marked]
    if unmarked:
        return PoolPlan(draining, tuple(Mark(pool, v) for v in unmarked))
    return PoolPlan(draining, (PatchScale(pool, desired.count, tuple(victims)),))


def _victims(candidates: dict[str, PodEndpoint], chosen: Sequence[str], wanted: int) -> list[str]:
    """Unready pods first (the ReplicaSet takes them first anyway), then the autoscaler's
    choice, then the others by name."""
    starting = sorted(n for n, p in candidates.items() if p.state is PodState.STARTING)
    picked = [n for n in dict.fromkeys(chosen) if n in candidates and n not in starting]
    rest = sorted(n for n in candidates if n not in starting and n not in picked)
    return [*starting, *picked, *rest][:wanted]
