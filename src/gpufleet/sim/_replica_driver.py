"""One replica model in virtual time: the kernel part that plans, waits out and finishes steps.

The driver is the fleet simulator's twin of the sim engine's real-time loop: it calls the
same two methods of the same model, and lets the kernel, not a sleep, carry time::

    submit(t, request) ─► add_request ─► idle? ─► StepStart @ t ──┐
                                                                  ▼
        ┌──────────── StepEnd @ t + plan.duration ◄── plan_step(t)
        ▼
    finish_step(plan, t') ─► record tokens ─► [run_decodes(t', horizon) ─► t'']
                                                    ─► plan_step(t'') ─► StepEnd @ ...
                                                          └─ None: idle until the next submit

Arrivals run before steps at the same instant (``URGENT`` before ``NORMAL``), so every
request that has arrived by ``t`` joins the step planned at ``t``; a step start on an idle
replica is an event of its own for the same reason.

Step events are local to the driver (only it reads or changes anything by them). Given a
``horizon`` (the kernel's ``next_shared``: nothing outside the driver looks at it before
then), the driver fast-forwards after each step: the model applies at once the pure-decode
steps that end before the horizon (``ReplicaModel.run_decodes``), and the driver records
them as it would have step by step. The results are the same to the bit; only the number
of kernel events and model calls drops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpufleet.engine.model import DecodeRun, NewRequest, ReplicaModel, StepPlan
from gpufleet.sim._kernel import NORMAL, Event, ScheduledEvent
from gpufleet.sim._recorder import Recorder, RequestRecord

EndHook = Callable[[float, int, int, bool], None]
"""``on_end(now, index, replica, rejected)``: trace request ``index`` left replica ``replica``."""

STEP_PRIORITY = NORMAL
"""Steps start and end after the arrivals of the same instant."""


@dataclass(frozen=True, slots=True)
class StepStart:
    """An idle replica starts stepping (scheduled at the instant work arrives)."""

    target: ReplicaDriver
    epoch: int = 0
    """The replica's incarnation: a crash makes the steps of the one before stale."""


@dataclass(frozen=True, slots=True)
class StepEnd:
    """The step in flight has run for its duration."""

    target: ReplicaDriver
    plan: StepPlan
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Lost:
    """A request that was inside a replica when it crashed."""

    index: int
    arrival: float
    first_token: float | None
    """When its first token came out (None: the client has seen nothing; retryable)."""
    input_tokens: int


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
    """Drives one :class:`ReplicaModel` on the kernel's clock and records its requests.

    ``horizon``, when given, returns the time before which nothing outside this driver reads
    or changes it (``Kernel.next_shared``); the driver then fast-forwards runs of pure-decode
    steps up to it. ``None`` steps one kernel event at a time. ``on_end``, when given, is
    told of every request that finishes or is refused, at the instant it does.
    """

    __slots__ = (
        "_busy",
        "_down_since",
        "_epoch",
        "_horizon",
        "_itl",
        "_live",
        "_model",
        "_on_end",
        "_recorder",
        "busy_s",
        "crashes",
        "downtime_s",
        "fast_runs",
        "fast_steps",
        "index",
        "retired_preemptions",
        "retired_prefix_hits",
        "retired_prefix_queries",
        "steps",
    )

    def __init__(
        self,
        index: int,
        model: ReplicaModel,
        recorder: Recorder,
        *,
        horizon: Callable[[], float] | None = None,
        on_end: EndHook | None = None,
    ) -> None:
        self.index = index
        self._on_end = on_end
        self._model = model
        self._recorder = recorder
        self._horizon = horizon
        self._itl = recorder.replica_itl(index)
        self._live: dict[str, _Live] = {}
        self._busy = False
        """A step is in flight or about to start."""
        self.steps = 0
        """Steps run, fast-forwarded ones included."""
        self.fast_steps = 0
        """Steps applied by fast-forwards (no kernel event, no plan, no outputs)."""
        self.fast_runs = 0
        """Fast-forwards: runs of one or more pure-decode steps applied at once."""
        self.busy_s = 0.0
        """Virtual seconds spent in steps."""
        self._epoch = 0
        self._down_since: float | None = None
        self.crashes = 0
        self.downtime_s = 0.0
        """Virtual seconds between crashes and the restarts that followed (so far)."""
        self.retired_preemptions = 0
        """Preemptions and prefix-cache counts of the incarnations before the last crash."""
        self.retired_prefix_queries = 0
        self.retired_prefix_hits = 0

    @property
    def down(self) -> bool:
        """Crashed and not yet restarted: it takes no request."""
        return self._down_since is not None

    def crash(self, now: float, fresh: ReplicaModel) -> list[Lost]:
        """The replica dies at ``now``: its requests are lost, its steps stale.

        ``fresh`` is the model of the process that will restart (an empty KV cache, no
        queue); it takes requests only after :meth:`restart`. Returns the lost requests in
        the order they were submitted.
        """
        if self.down:
            return []
        stats = self._model.stats()
        self.retired_preemptions += stats.num_preemptions
        self.retired_prefix_queries += stats.prefix_cache_queries
        self.retired_prefix_hits += stats.prefix_cache_hits
        lost = [Lost(s.index, s.arrival, s.first, s.input_tokens) for s in self._live.values()]
        self._live.clear()
        self._model = fresh
        self._epoch += 1
        self._busy = False
        self._down_since = now
        self.crashes += 1
        return lost

    def restart(self, now: float) -> None:
        """The restarted process is up (provisioned, model loaded) at ``now``."""
        if self._down_since is None:
            return
        self.downtime_s += now - self._down_since
        self._down_since = None

    def downtime(self, now: float) -> float:
        """Seconds down up to ``now`` (a replica still down counts until ``now``)."""
        since = self._down_since
        return self.downtime_s + (0.0 if since is None else max(0.0, now - since))

    @property
    def model(self) -> ReplicaModel:
        """The replica model (read it; only the driver steps it)."""
        return self._model

    @property
    def num_requests(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        return len(self._live)

    def submit(
        self, now: float, index: int, request: NewRequest, arrival: float | None = None
    ) -> list[ScheduledEvent]:
        """Hand trace request ``index`` to the replica at ``now``.

        ``arrival`` is when the request reached the fleet (earlier than ``now`` for a retry;
        its latencies count from there). A request the replica refuses (too long for
        ``max_model_len``) is recorded as rejected at once.
        """
        if self.down:
            raise RuntimeError(f"replica {self.index} is down: route around it")
        arrival = now if arrival is None else arrival
        try:
            self._model.add_request(request, now)
        except ValueError:
            self._recorder.log.append(
                RequestRecord(
                    index, self.index, arrival, None, now, len(request.prompt_token_ids), 0, 0, True
                )
            )
            if self._on_end is not None:
                self._on_end(now, index, self.index, True)
            return []
        self._live[request.request_id] = _Live(index, arrival, len(request.prompt_token_ids))
        if self._busy:
            return []
        self._busy = True
        return [ScheduledEvent(now, STEP_PRIORITY, StepStart(self, self._epoch), local=True)]

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, StepStart | StepEnd), event
        if event.epoch != self._epoch:
            return []  # a step of the incarnation before a crash
        if isinstance(event, StepEnd):
            self._finish(now, event.plan)
            if self._horizon is not None:
                run = self._model.run_decodes(now, self._horizon())
                if run is not None:
                    now = self._record_run(now, run)
        plan = self._model.plan_step(now)
        if plan is None:
            self._busy = False
            return []
        self.steps += 1
        self.busy_s += plan.duration
        return [
            ScheduledEvent(
                now + plan.duration, STEP_PRIORITY, StepEnd(self, plan, self._epoch), local=True
            )
        ]

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
                if self._on_end is not None:
                    self._on_end(now, state.index, self.index, False)
        itl = self._itl
        for gap, count in gaps.items():
            itl.add(gap, count)

    def _record_run(self, now: float, run: DecodeRun) -> float:
        """Record a fast-forwarded run as its steps' ``_finish`` would have; its end time.

        Step times are summed from ``now`` one duration at a time, as the kernel would have
        (``now + plan.duration`` per StepEnd), and gaps taken as differences of those times,
        so every float matches the step-by-step run. The first step's gaps are each request's
        own (one may not have produced a token in the step before); after it, all requests
        share each step's gap: one histogram count of ``n`` per step, in step order.
        """
        live = self._live
        states = [live[rid] for rid in run.request_ids]
        itl = self._itl
        durations = run.durations
        t = now + durations[0]
        gaps: dict[float, int] = {}
        for state in states:
            gap = t - state.last
            gaps[gap] = gaps.get(gap, 0) + 1
        for gap, count in gaps.items():
            itl.add(gap, count)
        busy = self.busy_s + durations[0]
        shared: list[float] = []
        add_gap = shared.append
        for duration in durations[1:]:
            end = t + duration
            add_gap(end - t)
            busy += duration
            t = end
        itl.add_each(shared, len(states))
        for state in states:
            state.last = t
        self.busy_s = busy
        self.steps += len(durations)
        self.fast_steps += len(durations)
        self.fast_runs += 1
        return t
