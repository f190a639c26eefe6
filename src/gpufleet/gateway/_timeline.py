"""The fleet's recent events, newest last, for ``GET /admin/events`` and the console.

::

    timeline.ejected(now, record)        # the controller's Ejected command (LiveControl)
    timeline.scaled(now, scale)          # a Scale command that acts (promotes, starts, drains)
    timeline.add(now, "replica", model, "llama-3.1-8b-0: starting → ready", replica=…)
    timeline.after(seq)                  # the entries after ``seq`` (a poller's last one)

The control decisions are the pool controllers'; this only remembers them, bounded
(``MAX_EVENTS``), in memory: the audit log is the durable record of what people did, and the
gateway's log and ``gpufleet up --record`` that of what the controllers did. Times are wall
clock (Unix seconds): the controller's clock is monotonic, so each entry is placed at
``wall() - (clock() - now)``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from gpufleet.control import EjectionRecord, Scale, ScaleDirection, decision_record

MAX_EVENTS: Final = 1000


class Timeline:
    """A bounded list of events, each with a sequence number for polling."""

    def __init__(self, clock: Callable[[], float], wall: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._wall = wall
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._seq = 0

    def add(
        self,
        now: float,
        kind: str,
        model: str | None,
        text: str,
        *,
        replica: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        self._seq += 1
        at = self._wall() - max(self._clock() - now, 0.0)
        self._events.append(
            {
                "seq": self._seq,
                "time": round(at, 3),
                "kind": kind,
                "model": model,
                "replica": replica,
                "text": text,
                "detail": detail or {},
            }
        )

    def ejected(self, now: float, record: EjectionRecord) -> None:
        if record.overflow:
            what = "not ejected: the pool's ejection limit is reached"
        elif record.enforced:
            what = f"ejected for {record.duration:g} s"
        else:
            what = "would be ejected (dry run)"
        self.add(
            now,
            "ejection",
            record.model,
            f"{record.replica} {what} ({record.cause.value})",
            replica=record.replica,
            detail={
                "cause": record.cause.value,
                "enforced": record.enforced,
                "overflow": record.overflow,
                "ejections": record.ejections,
                "duration_s": record.duration,
            },
        )

    def scaled(self, now: float, scale: Scale) -> None:
        """Remember a decision that acts; the many that hold add nothing."""
        decision = scale.decision
        if not (
            decision.direction is not ScaleDirection.HOLD
            or decision.promote
            or decision.drain
            or decision.cold_starts
        ):
            return
        record = decision_record(decision, scale.view)
        text = (
            f"scale {decision.direction.value} to {decision.desired} "
            f"(from {decision.inputs.current}; {decision.bound_by.value})"
        )
        self.add(now, "scale", decision.model, text, detail=record)

    def after(self, seq: int = 0, limit: int = MAX_EVENTS) -> list[dict[str, Any]]:
        """The entries after ``seq``, oldest first, at most the ``limit`` newest."""
        fresh = [e for e in self._events if e["seq"] > seq]
        return fresh[-limit:]

    @property
    def last(self) -> int:
        return self._seq
