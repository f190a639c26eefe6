"""One replica model in virtual time: the kernel part that plans, waits out and finishes steps.

The driver is the fleet simulator's twin of the sim engine's real-time loop: it calls the
same two methods of the same model, and lets the kernel, not a sleep, carry time::

    submit(t, request) ─► add_request ─► idle? ─► StepStart @ t ──┐
                                                                  ▼
        ┌──────────── StepEnd @ t + plan.duration ◄── plan_step(t)
        ▼
    finish_step(plan, t') ─► record tokens ─► plan_step(t') ─► StepEnd @ t' + duration ...
                                                   └─ None: idle until the next submit

Arrivals run before steps at the same instant (``URGENT`` before ``NORMAL``), so every
request that has arrived by ``t`` joins the step planned at ``t``; a step start on an idle
replica is an event of its own for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.engine.model import NewRequest, ReplicaModel, StepPlan
from gpufleet.sim._kernel import NORMAL, Event, ScheduledEvent
from gpufleet.sim._recorder import Recorder, RequestRecord

STEP_PRIORITY = NORMAL
"""Steps start and end after the arrivals of the same instant."""


@dataclass(frozen=True, slots=True)
class StepStart:
    """An idle replica starts stepping (scheduled at the instant work arrives)."""

    target: ReplicaDriver


@dataclass(frozen=True, slots=True)
class StepEnd:
    """The step in flight has run for its duration."""

    target: ReplicaDriver
    plan: StepPlan


class _Live:
    """A request inside the replica: what its record needs, nothing per token."""

    __slots__ = ("arrival", "first", "index", "input_tokens", "last")

    def __init__(self, index: int, arrival: float, input_tokens: int) -> None:
        self.index = index
        self.arrival = arrival
        self.input_tokens = input_tokens
        self.first: float | None = None
        self.last = arrival


class ReplicaDriver:
    """Drives one :class:`ReplicaModel` on the kernel's clock and records its requests."""

    __slots__ = ("_busy", "_itl", "_live", "_model", "_recorder", "busy_s", "index", "steps")

    def __init__(self, index: int, model: ReplicaModel, recorder: Recorder) -> None:
        self.index = index
        self._model = model
        self._recorder = recorder
        self._itl = recorder.replica_itl(index)
        self._live: dict[str, _Live] = {}
        self._busy = False
        """A step is in flight or about to start."""
        self.steps = 0
        self.busy_s = 0.0
        """Virtual seconds spent in steps."""

    @property
    def model(self) -> ReplicaModel:
        """The replica model (read it; only the driver steps it)."""
        return self._model

    @property
    def num_requests(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        return len(self._live)

    def submit(self, now: float, index: int, request: NewRequest) -> list[ScheduledEvent]:
        """Hand trace request ``index`` to the replica at ``now``.

        A request the replica refuses (too long for ``max_model_len``) is recorded as
        rejected at once.
        """
        try:
            self._model.add_request(request, now)
        except ValueError:
            self._recorder.log.append(
                RequestRecord(
                    index, self.index, now, None, now, len(request.prompt_token_ids), 0, 0, True
                )
            )
            return []
        self._live[request.request_id] = _Live(index, now, len(request.prompt_token_ids))
        if self._busy:
            return []
        self._busy = True
        return [ScheduledEvent(now, STEP_PRIORITY, StepStart(self))]

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        if isinstance(event, StepEnd):
            self._finish(now, event.plan)
        plan = self._model.plan_step(now)
        if plan is None:
            self._busy = False
            return []
        self.steps += 1
        self.busy_s += plan.duration
        return [ScheduledEvent(now + plan.duration, STEP_PRIORITY, StepEnd(self, plan))]

    def _finish(self, now: float, plan: StepPlan) -> None:
        live, log = self._live, self._recorder.log
        gaps: dict[float, int] = {}  # requests that produced a token last step share one gap
        for out in self._model.finish_step(plan, now):
            state = live[out.request_id]
            if out.first_token:
                state.first = now
            else:
                gap = now - state.last
                gaps[gap] = gaps.get(gap, 0) + 1
            state.last = now
            if out.finish_reason is not None:
                del live[out.request_id]
                log.append(
                    RequestRecord(
                        state.index,
                        self.index,
                        state.arrival,
                        state.first,
                        now,
                        state.input_tokens,
                        out.num_output_tokens,
                        out.num_cached_tokens,
                        False,
                    )
                )
        itl = self._itl
        for gap, count in gaps.items():
            itl.add(gap, count)
