"""The OpenAI batch lifecycle as a pure state machine (docs/batch.md).

::

    validating ──► in_progress ──► finalizing ──► completed
        │  │  │         │  │
        │  │  │         │  └──────────────────────► expired    (the window ran out first)
        │  │  └─────────┼─────────────────────────► expired
        │  │            └──► cancelling ──► cancelled
        │  └───────────────► cancelling
        └──► failed            (the input file did not validate)

A status only moves along an arrow; the four at the right end are terminal. The store moves
a batch with a compare-and-set on its status (``UPDATE … WHERE status IN batch_sources(target)``),
so two gateways that decide the same move apply it once. :func:`next_batch_status` is the decision
a runner asks for at every tick; moving out of ``validating`` is the validation's own
outcome (``in_progress`` or ``failed``), so it decides only expiry there.

The conserved quantity: every line of a batch ends *done* exactly once, with a response or an
error; ``completed + failed == total`` in every terminal status that ran (lines a batch
never ran when it expired or was cancelled are done with an error saying so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

BATCH_ENDPOINTS: Final = ("/v1/chat/completions", "/v1/completions")
"""The endpoints a batch may run (one per batch: every line's ``url``)."""
BATCH_WINDOWS: Final[Mapping[str, float]] = {"24h": 24 * 3600.0}
"""Completion windows, in seconds: OpenAI accepts only ``24h``."""
BATCH_CANCEL_GRACE_S: Final = 600.0
"""How long a batch stays ``cancelling`` while lines are in flight (OpenAI: up to 10 min)."""


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


_S = BatchStatus
BATCH_TERMINAL: Final = frozenset({_S.FAILED, _S.COMPLETED, _S.EXPIRED, _S.CANCELLED})
BATCH_RUNNING: Final = frozenset({_S.IN_PROGRESS, _S.CANCELLING})
"""Statuses in which a line's result is recorded (in flight when the batch was cancelled)."""
BATCH_CANCELLABLE: Final = frozenset({_S.VALIDATING, _S.IN_PROGRESS})
BATCH_TRANSITIONS: Final[Mapping[BatchStatus, frozenset[BatchStatus]]] = {
    _S.VALIDATING: frozenset({_S.IN_PROGRESS, _S.FAILED, _S.CANCELLING, _S.EXPIRED}),
    _S.IN_PROGRESS: frozenset({_S.FINALIZING, _S.CANCELLING, _S.EXPIRED}),
    _S.FINALIZING: frozenset({_S.COMPLETED}),
    _S.CANCELLING: frozenset({_S.CANCELLED}),
    _S.FAILED: frozenset(),
    _S.COMPLETED: frozenset(),
    _S.EXPIRED: frozenset(),
    _S.CANCELLED: frozenset(),
}
BATCH_TIMESTAMPS: Final[Mapping[BatchStatus, str]] = {
    _S.IN_PROGRESS: "in_progress_at",
    _S.FINALIZING: "finalizing_at",
    _S.COMPLETED: "completed_at",
    _S.FAILED: "failed_at",
    _S.EXPIRED: "expired_at",
    _S.CANCELLING: "cancelling_at",
    _S.CANCELLED: "cancelled_at",
}
"""The batch object's field set, once, when the batch enters each status."""


def batch_can_move(source: BatchStatus, target: BatchStatus) -> bool:
    return target in BATCH_TRANSITIONS[source]


def batch_sources(target: BatchStatus) -> frozenset[BatchStatus]:
    """Every status from which ``target`` may be entered."""
    return frozenset(s for s, targets in BATCH_TRANSITIONS.items() if target in targets)


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """The batch object's ``request_counts``: lines, and those done with a 2xx or not."""

    total: int = 0
    completed: int = 0
    failed: int = 0

    def to_openai(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """What :func:`next_batch_status` needs to know of a batch at ``now``."""

    status: BatchStatus
    expires_at: float
    counts: RequestCounts = RequestCounts()
    in_flight: int = 0
    """Lines claimed by a worker whose lease has not run out."""
    cancelling_at: float | None = None

    @property
    def unfinished(self) -> int:
        """Lines not done: waiting to be claimed, or in flight."""
        return self.counts.total - self.counts.completed - self.counts.failed


def next_batch_status(
    now: float, progress: BatchProgress, *, cancel_grace_s: float = BATCH_CANCEL_GRACE_S
) -> BatchStatus | None:
    """The status ``progress``'s batch should move to at ``now``, or ``None`` to stay.

    Every line done beats the window: a batch whose last line finished just after its
    window ends is completed, not expired.
    """
    p = progress
    if p.status is _S.VALIDATING:
        return _S.EXPIRED if now >= p.expires_at else None
    if p.status is _S.IN_PROGRESS:
        if p.unfinished == 0:
            return _S.FINALIZING
        return _S.EXPIRED if now >= p.expires_at else None
    if p.status is _S.FINALIZING:
        return _S.COMPLETED
    if p.status is _S.CANCELLING:
        started = p.cancelling_at if p.cancelling_at is not None else now
        if p.in_flight == 0 or now >= started + cancel_grace_s:
            return _S.CANCELLED
    return None
