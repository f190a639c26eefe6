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

With the kernel as well (``kernel=``, what the harness passes), a run that would reach past
the horizon is not cut there but deferred: the driver asks the model where its run of
pure-decode steps would end (``ReplicaModel.decode_run_end``) and schedules one local
``RunEnd`` there, applying nothing yet. In a big fleet the horizon is the next arrival
*anywhere* (every 1.4 ms at 1,000 replicas), far shorter than a replica's runs (~1 s), so
cutting at it would still cost an event per step::

    StepEnd @ t0 ─► decode_run_end(t0) = (T, k) ─► RunEnd @ T      (nothing applied yet)
        someone looks at the replica at t < T (a submit, a scrape, a sample, a crash):
            catch_up(t): run_decodes(t0, t) ─► plan_step ─► StepEnd @ ≥ t   (as if cut at t)
        nobody does: RunEnd @ T: run_decodes(t0, T) (k - 1 steps), plan and finish step k

Whoever reads the replica from outside goes through :attr:`model` (or :attr:`busy_s`,
:attr:`steps`, :meth:`submit`, :meth:`crash`), which first catches it up to the kernel's
``now``; the state it then sees is exactly the step-by-step one. A run ends before any
request finishes, so every end still happens at its own kernel event, in time order. A
``RunEnd`` whose run was caught up is skipped when it comes (``stale_events``), unless the
run that follows ends at the same instant, which then reuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, islice
from operator import add, sub

from gpufleet.engine.model import (
    DecodeRun,
    KvCacheEvent,
    NewRequest,
    ReplicaModel,
    RunAhead,
    StepPlan,
)
from gpufleet.sim._kernel import NORMAL, Event, Kernel, ScheduledEvent
from gpufleet.sim._recorder import Recorder, RequestRecord

EndHook = Callable[[float, int, int, bool], None]
"""``on_end(now, index, replica, rejected)``: trace request ``index`` left replica ``replica``."""
KvHook = Callable[[float, int, list[KvCacheEvent]], None]
"""``on_kv(now, replica, events)``: replica ``replica``'s prefix cache did this in a step."""

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
class RunEnd:
    """A deferred run of pure-decode steps ends: its last step's end."""

    target: ReplicaDriver
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Lost:
    """A request that was inside a replica when it crashed."""

    index: int
    arrival: float
    first_token: float | None
    """When its first token came out (None: the client has seen nothing; retryable)."""
    input_tokens: int
    """Its prompt as the client sent it (a resumed stream's: the first attempt's)."""
    last_token: float | None = None
    """When its last token came out (a resume's first gap counts from here)."""
    generated: tuple[int, ...] = ()
    """The tokens this attempt generated (a resume re-sends them after the prompt)."""
    continues_at: int | None = None
    """Where its output goes on (``Progress.next_position``)."""


@dataclass(frozen=True, slots=True)
class Resume:
    """A stream resumed here after its replica crashed: what the client already has."""

    first_token: float
    last_token: float
    carried: int
    """Tokens sent before (the output counts them too)."""
    input_tokens: int
    """The prompt as the client sent it (the row's input)."""


class _Live:
    """A request inside the replica: what its record needs, nothing per token."""

    __slots__ = ("arrival", "carried", "first", "index", "input_tokens", "last")

    def __init__(self, index: int, arrival: float, input_tokens: int) -> None:
        self.index = index
        self.arrival = arrival
        self.input_tokens = input_tokens
        self.first: float | None = None
        self.last = arrival
        self.carried = 0


class ReplicaDriver:
    """Drives one :class:`ReplicaModel` on the kernel's clock and records its requests.

    ``horizon``, when given, returns the time before which nothing outside this driver reads
    or changes it (``Kernel.next_shared``); the driver then fast-forwards runs of pure-decode
    steps up to it. ``None`` steps one kernel event at a time. ``on_end``, when given, is
    told of every request that finishes or is refused, at the instant it does.
    """

    __slots__ = (
        "_ahead",
        "_busy",
        "_busy_s",
        "_down_since",
        "_epoch",
        "_horizon",
        "_hung_at",
        "_itl",
        "_kernel",
        "_live",
        "_model",
        "_on_end",
        "_recorder",
        "_run_at",
        "_run_from",
        "_stalled",
        "_steps",
        "crashes",
        "downtime_s",
        "fast_runs",
        "fast_steps",
        "index",
        "on_kv",
        "retired_preemptions",
        "retired_prefix_hits",
        "retired_prefix_queries",
        "stale_events",
    )

    def __init__(
        self,
        index: int,
        model: ReplicaModel,
        recorder: Recorder,
        *,
        horizon: Callable[[], float] | None = None,
        on_end: EndHook | None = None,
        kernel: Kernel | None = None,
        defer: bool = False,
    ) -> None:
        self.index = index
        self._kernel = kernel if horizon is not None or defer else None
        """Given with ``horizon``: runs past it are deferred, not cut (module docstring)."""
        self._run_from: float | None = None
        """A deferred run is pending: it starts here (the replica's state is as of then)."""
        self._ahead: RunAhead | None = None
        """The pending run's steps, priced (valid while ``_run_from`` is set)."""
        self._run_at: float | None = None
        """When the ``RunEnd`` event in the kernel's heap falls (None: there is none)."""
        self.stale_events = 0
        """``RunEnd`` events that came after their run had been caught up."""
        self._on_end = on_end
        self.on_kv: KvHook | None = None
        """Told each step's KV events (a model with ``kv_events``), before its ends."""
        self._model = model
        self._recorder = recorder
        self._horizon = horizon
        self._itl = recorder.replica_itl(index)
        self._live: dict[str, _Live] = {}
        self._busy = False
        """A step is in flight or about to start."""
        self._steps = 0
        self.fast_steps = 0
        """Steps applied by fast-forwards (no kernel event, no plan, no outputs)."""
        self.fast_runs = 0
        """Fast-forwards: runs of one or more pure-decode steps applied at once."""
        self._busy_s = 0.0
        self._epoch = 0
        self._down_since: float | None = None
        self._hung_at: float | None = None
        """The process stopped here (a hang): its step events wait in ``_stalled``."""
        self._stalled: list[tuple[float, StepStart | StepEnd]] = []
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
        self.catch_up()
        stats = self._model.stats()
        self.retired_preemptions += stats.num_preemptions
        self.retired_prefix_queries += stats.prefix_cache_queries
        self.retired_prefix_hits += stats.prefix_cache_hits
        lost = [self._lost(rid, s) for rid, s in self._live.items()]
        self._live.clear()
        self._hung_at, self._stalled = None, []  # a hung process can be killed
        self._model = fresh
        self._epoch += 1
        self._busy = False
        self._run_from = self._run_at = None
        self._down_since = now
        self.crashes += 1
        return lost

    def hang(self, now: float) -> None:
        """The process stops at ``now`` (SIGSTOP, a wedged GPU): the step in flight ends
        only after :meth:`wake`, as late as the hang was long; nothing new starts."""
        if self.down or self._hung_at is not None:
            return
        self.catch_up()  # a deferred run becomes the step in flight, stalled below
        self._hung_at = now

    def wake(self, now: float) -> list[ScheduledEvent]:
        """The process goes on at ``now``: a stalled step ends its remaining time later; an
        idle replica given work meanwhile starts stepping now."""
        hung_at, self._hung_at = self._hung_at, None
        if hung_at is None:
            return []
        stalled, self._stalled = self._stalled, []
        return [
            ScheduledEvent(
                now + (t - hung_at) if isinstance(e, StepEnd) else now, STEP_PRIORITY, e, local=True
            )
            for t, e in stalled
        ]

    def abandon(self, now: float, indices: Collection[int]) -> list[Lost]:
        """Requests ``indices`` leave the replica at ``now`` as a cut connection leaves an
        engine (the gateway abandoned their attempts: ``control.Abandon``); the replica goes
        on with the rest. Returns them as :meth:`crash` does, in the order submitted."""
        if self.down:
            return []
        self.catch_up()
        gone = [(rid, s) for rid, s in self._live.items() if s.index in indices]
        lost = [self._lost(rid, s) for rid, s in gone]
        for rid, _ in gone:
            self._model.abort(rid, now)
            del self._live[rid]
        return lost

    def _lost(self, rid: str, s: _Live) -> Lost:
        progress = self._model.progress(rid)
        return Lost(
            s.index,
            s.arrival,
            s.first,
            s.input_tokens,
            s.last if s.first is not None else None,
            () if progress is None else progress.output_token_ids,
            None if progress is None else progress.next_position,
        )

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
        """The replica model as of the kernel's ``now`` (read it; only the driver steps it)."""
        if self._run_from is not None:
            self.catch_up()
        return self._model

    def load(self) -> tuple[int, int, float]:
        """``(num_running, num_waiting, kv_cache_usage)`` as of the kernel's ``now``, what a
        scrape reads: ``model.load()``, but a pending run is not caught up for it (the run
        goes on as if nobody had looked; the same numbers, from its priced steps)."""
        if self._run_from is not None:
            ahead, kernel = self._ahead, self._kernel
            assert ahead is not None
            assert kernel is not None
            if kernel.now <= ahead.end:
                return ahead.load_at(kernel.now)
        return self.model.load()

    @property
    def steps(self) -> int:
        """Steps run, fast-forwarded ones included."""
        if self._run_from is not None:
            self.catch_up()
        return self._steps

    @property
    def busy_s(self) -> float:
        """Virtual seconds spent in steps."""
        if self._run_from is not None:
            self.catch_up()
        return self._busy_s

    def catch_up(self) -> None:
        """Apply a deferred run up to the kernel's ``now``, and plan the step in flight then:
        the replica is as it would be had the run been cut at ``now``."""
        start, kernel = self._run_from, self._kernel
        if start is None or kernel is None:
            return
        self._run_from = None
        now = kernel.now
        run = self._model.run_decodes(start, now)
        kernel.schedule_all(self._plan(start if run is None else self._record_run(start, run)))

    @property
    def num_requests(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        return len(self._live)

    def submit(
        self,
        now: float,
        index: int,
        request: NewRequest,
        arrival: float | None = None,
        resume: Resume | None = None,
    ) -> list[ScheduledEvent]:
        """Hand trace request ``index`` to the replica at ``now``.

        ``arrival`` is when the request reached the fleet (earlier than ``now`` for a retry;
        its latencies count from there). ``resume``: a stream that broke elsewhere goes on
        here (its row counts the whole answer: its first token, the tokens sent before, the
        client's prompt). A request the replica refuses (too long for ``max_model_len``) is
        recorded as rejected at once.
        """
        if self.down:
            raise RuntimeError(f"replica {self.index} is down: route around it")
        if self._run_from is not None:
            self.catch_up()
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
        live = self._live[request.request_id] = _Live(index, arrival, len(request.prompt_token_ids))
        if resume is not None:
            live.first, live.last = resume.first_token, resume.last_token
            live.carried, live.input_tokens = resume.carried, resume.input_tokens
        if self._busy:
            return []
        self._busy = True
        return [ScheduledEvent(now, STEP_PRIORITY, StepStart(self, self._epoch), local=True)]

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, StepStart | StepEnd | RunEnd), event
        if event.epoch != self._epoch:
            return []  # a step of the incarnation before a crash
        if self._hung_at is not None and not isinstance(event, RunEnd):
            self._stalled.append((now, event))  # a stopped process: on at :meth:`wake`
            return []
        if isinstance(event, StepEnd):
            self._finish(now, event.plan)
            return self._advance(now)
        if isinstance(event, RunEnd):
            if now == self._run_at:
                self._run_at = None  # it has left the heap
                if self._run_from is not None:
                    return self._end_run(now)
            self.stale_events += 1  # its run was caught up meanwhile
            return []
        return self._plan(now)

    def _advance(self, now: float) -> list[ScheduledEvent]:
        """After a step ends at ``now``: fast-forward (or defer) a decode run, plan the next."""
        horizon, kernel = self._horizon, self._kernel
        if horizon is None and kernel is None:
            return self._plan(now)
        if kernel is not None:
            ahead = self._model.decode_run_ahead(now)
            if (
                ahead is not None
                and ahead.steps > 1
                and (horizon is None or ahead.end >= horizon())
            ):
                self._run_from = now  # someone may look before it ends: defer it
                self._ahead = ahead
                end = ahead.end
                if self._run_at == end:
                    return []  # the RunEnd of the run caught up before ends here too
                self._run_at = end
                return [ScheduledEvent(end, STEP_PRIORITY, RunEnd(self, self._epoch), local=True)]
        if horizon is None:  # deferring only: nothing is applied ahead of now
            return self._plan(now)
        run = self._model.run_decodes(now, horizon())
        if run is not None:
            now = self._record_run(now, run)
        return self._plan(now)

    def _end_run(self, now: float) -> list[ScheduledEvent]:
        """A deferred run ends at ``now``: its steps but the last at once, then the last one
        as an ordinary step that ends now (it stands for that step's ``StepEnd``)."""
        start = self._run_from
        assert start is not None
        self._run_from = None
        model = self._model
        run = model.run_decodes(start, now)
        t = start if run is None else self._record_run(start, run)
        plan = model.plan_step(t)
        assert plan is not None
        assert t + plan.duration == now, (t, plan.duration, now)  # summed as decode_run_end
        self._steps += 1
        self._busy_s += plan.duration
        self._finish(now, plan)
        return self._advance(now)

    def _plan(self, now: float) -> list[ScheduledEvent]:
        plan = self._model.plan_step(now)
        if plan is None:
            self._busy = False
            return []
        self._steps += 1
        self._busy_s += plan.duration
        return [
            ScheduledEvent(
                now + plan.duration, STEP_PRIORITY, StepEnd(self, plan, self._epoch), local=True
            )
        ]

    def _finish(self, now: float, plan: StepPlan) -> None:
        live, log = self._live, self._recorder.log
        gaps: dict[float, int] = {}  # requests that produced a token last step share one gap
        outs = self._model.finish_step(plan, now)
        if self.on_kv is not None and (events := self._model.take_kv_events()):
            self.on_kv(now, self.index, events)  # as an engine publishes: before the answers
        for out in outs:
            state = live[out.request_id]
            if out.first_token and state.first is None:
                state.first = now
            else:  # a resumed stream's first token here: its gap is the client's stall
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
                        out.num_output_tokens + state.carried,
                        min(out.num_cached_tokens, state.input_tokens),
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
        # times[i] = now + durations[0] + ... + durations[i - 1], added left to right as the
        # kernel adds them; the shared gaps are differences of neighbouring times
        times = run.times
        if times is None or times[0] != now:
            times = list(accumulate(durations, add, initial=now))
        t = times[1]
        gaps: dict[float, int] = {}
        for state in states:
            gap = t - state.last
            gaps[gap] = gaps.get(gap, 0) + 1
        for gap, count in gaps.items():
            itl.add(gap, count)
        if len(times) > 2:
            shared = list(map(sub, islice(times, 2, None), islice(times, 1, None)))
            itl.add_each(shared, len(states))
        t = times[-1]
        for state in states:
            state.last = t
        self._busy_s = reduce(add, durations, self._busy_s)
        self._steps += len(durations)
        self.fast_steps += len(durations)
        self.fast_runs += 1
        if self.on_kv is not None and (events := self._model.take_kv_events()):
            # a run ends before the next shared event (an arrival): the router has its
            # blocks before it decides again, as it would have step by step
            self.on_kv(t, self.index, events)
        return t
