"""N+1: does a pool have a spare replica beyond what its load needs?"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.fleet import ROUTABLE, FleetView


@dataclass(frozen=True, slots=True)
class Redundancy:
    """A pool's routable replicas against the ``required`` its load needs."""

    model: str
    routable: int
    required: int

    @property
    def spare(self) -> bool:
        """One replica can fail (or be drained for a rollout) and the load still fits."""
        return self.routable >= self.required + 1

    @property
    def missing(self) -> int:
        """Replicas to add to get back to N+1."""
        return max(0, self.required + 1 - self.routable)


def redundancy(view: FleetView, model: str, required: int) -> Redundancy:
    """N+1 check of ``model``'s pool: ``required`` is N, the replicas its load needs (from
    the capacity plan or the autoscaler). The shell raises a metric and warns when
    ``spare`` is false."""
    if required < 0:
        raise ValueError(f"required replicas must be >= 0, got {required}")
    routable = sum(1 for r in view.pool(model) if r.state in ROUTABLE)
    return Redundancy(model, routable, required)
