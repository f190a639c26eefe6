"""What the shells report to the health policy: request outcomes and probe results.

Events carry no time: the receiver is called as ``on_event(now, event)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.fleet._replica import ReplicaId
from gpufleet.fleet._request import Outcome


@dataclass(slots=True)  # made per request: not frozen (cheaper); never changed
class RequestFinished:
    """A request sent to ``replica`` ended with ``outcome`` (one event per attempt)."""

    replica: ReplicaId
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """An active health check of ``replica`` answered (``ok``) or failed or timed out."""

    replica: ReplicaId
    ok: bool


FleetEvent = RequestFinished | ProbeResult
"""Every event a policy's ``on_event`` accepts."""
