"""A minimal fleet: a trace, a few replica drivers and a routing function between them.

    harness = FleetHarness([ReplicaModel(config) for _ in range(8)], prompts, choose=RoundRobin())
    harness.start(load_trace("AzureLLMInferenceTrace_conv.csv"))
    harness.run()                     # or run(until=t) in slices, to show progress
    harness.recorder.log              # one row per request

Arrivals are fed one at a time: the harness holds the next trace request and schedules its
arrival when the previous one is delivered, so the trace is never in memory::

    Arrival(i) @ t_i ─► choose(now, request, drivers) ─► drivers[k].submit(...)
                    └─► next(trace) ─► Arrival(i + 1) @ t_(i+1)

The routing seam is a :class:`Routing`: ``route(now, index, request, prompt, replicas)``
at each arrival and ``on_end(now, index, replica, rejected)`` at each end. A plain
``choose(now, request, replicas) -> index`` function is enough when nothing needs the ends
(round robin, the default); :class:`~gpufleet.sim.SimControl` puts the gateway's own
routers (``gpufleet.policy``) there. ``every(interval, callback)`` runs a periodic observer
(the gateway's metric scrapes, the report's samples) while the trace lasts.

Arrivals are the kernel's shared events (a router may read every replica); the replicas'
steps are local to them. So between two arrivals each replica may fast-forward its runs of
pure-decode steps (``fast_forward=True``, the default); ``fast_forward=False`` steps one
kernel event at a time, with byte-identical results (``Recorder.digest()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufleet.engine.model import NewRequest, ReplicaModel
from gpufleet.fleet import Outcome
from gpufleet.sim._kernel import URGENT, Event, Kernel, ScheduledEvent
from gpufleet.sim._prompts import PromptBuilder
from gpufleet.sim._recorder import Recorder, RequestRecord
from gpufleet.sim._replica_driver import KvHook, Lost, ReplicaDriver, Resume
from gpufleet.sim._traces import TraceRequest

ARRIVAL_PRIORITY = URGENT
"""Arrivals come before the steps of the same instant (they join the step planned then)."""
TICK_PRIORITY = URGENT
"""Periodic observers (scrapes, samples) too: they see the fleet as the instant begins."""

Chooser = Callable[[float, TraceRequest, Sequence[ReplicaDriver]], int]
"""``choose(now, request, replicas) -> index``: which replica serves a request."""


class Routing(Protocol):
    """The routing seam in full: a choice that may read the prompt, and each request's end.

    ``route`` is asked at the request's arrival, after its prompt ids are built (a prefix-aware
    router hashes them); ``on_end`` is told when the request finishes or the replica refuses
    it. :class:`~gpufleet.sim.SimControl` puts the pool controller here.
    """

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int | None: ...

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None: ...

    def on_lost(
        self,
        now: float,
        index: int,
        replica: int,
        started: bool,
        outcome: Outcome = Outcome.CONNECT_FAILURE,
    ) -> list[ScheduledEvent]:
        """Request ``index`` was lost in a crash of ``replica`` (or its attempt abandoned
        there: ``outcome`` ``TIMEOUT``): retry it (:meth:`FleetHarness.submit_retry`), resume
        its stream (``started``: the client had its first token;
        :meth:`FleetHarness.submit_resume`) or let it end in an error (do nothing, or
        :meth:`FleetHarness.fail_lost`).
        """
        ...


class Gate(Protocol):
    """What stands between an arrival and its routing (the gateway's admission queue,
    :class:`~gpufleet.sim.SimControl`): it starts the request now or later through
    :meth:`FleetHarness.submit_new`, or refuses it through :meth:`FleetHarness.refuse`."""

    def arrive(
        self, now: float, index: int, request: TraceRequest, prompt: tuple[int, ...]
    ) -> list[ScheduledEvent]: ...


class ChooserRouting:
    """A plain ``choose`` function as a :class:`Routing` (it never hears of ends)."""

    __slots__ = ("choose",)

    def __init__(self, choose: Chooser) -> None:
        self.choose = choose

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int:
        return self.choose(now, request, replicas)

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None:
        return None

    def on_lost(
        self,
        now: float,
        index: int,
        replica: int,
        started: bool,
        outcome: Outcome = Outcome.CONNECT_FAILURE,
    ) -> list[ScheduledEvent]:
        return []


class RoundRobin:
    """Replica 0, 1, ..., n - 1, 0, ... in arrival order."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, now: float, request: TraceRequest, replicas: Sequence[ReplicaDriver]) -> int:
        chosen = self.next % len(replicas)
        self.next = chosen + 1
        return chosen


@dataclass(frozen=True, slots=True)
class Arrival:
    """Trace request ``index`` arrives at the fleet."""

    target: FleetHarness
    index: int
    request: TraceRequest


@dataclass(frozen=True, slots=True)
class Tick:
    """The ``count``-th tick of a periodic observer (a scrape, a sample)."""

    target: FleetHarness
    start: float
    interval: float
    count: int
    callback: Callable[[float], None]


class FleetHarness:
    """Replica drivers on one kernel, fed by a trace through a routing seam.

    ``choose`` (a plain function) or ``routing`` (a :class:`Routing`) picks the replica;
    round robin when neither is given.
    """

    __slots__ = (
        "_defer",
        "_horizon",
        "_lost",
        "_more",
        "_requests",
        "_sent",
        "_trace",
        "drivers",
        "failed",
        "gate",
        "kernel",
        "kv_hook",
        "live",
        "prompts",
        "recorder",
        "resume_prefill_tokens",
        "resumed",
        "routing",
    )

    def __init__(
        self,
        replicas: Sequence[ReplicaModel],
        prompts: PromptBuilder,
        *,
        choose: Chooser | None = None,
        routing: Routing | None = None,
        kernel: Kernel | None = None,
        recorder: Recorder | None = None,
        fast_forward: bool = True,
        run_ahead: bool = True,
    ) -> None:
        """``fast_forward``: replicas skip their runs of pure-decode steps (deferred, caught
        up when looked at). ``run_ahead`` too: a run that ends before the next shared event
        is applied at once, ahead of the kernel's ``now``. Without it nothing is applied
        ahead of ``now`` (no ``next_shared`` promise), so a local event's shared consequence
        (a queued request routed when another ends) takes effect at its own instant."""
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        if choose is not None and routing is not None:
            raise ValueError("give choose or routing, not both")
        self.kernel = kernel if kernel is not None else Kernel()
        self.recorder = recorder if recorder is not None else Recorder()
        horizon = self.kernel.next_shared if fast_forward and run_ahead else None
        self._horizon = horizon
        self._defer = fast_forward
        self.drivers = [
            ReplicaDriver(
                i,
                m,
                self.recorder,
                horizon=horizon,
                on_end=self._ended,
                kernel=self.kernel,
                defer=fast_forward,
            )
            for i, m in enumerate(replicas)
        ]
        self.kv_hook: KvHook | None = None
        """Where the replicas' KV events go (set before the run; new replicas get it too)."""
        self.prompts = prompts
        if routing is None:
            routing = ChooserRouting(choose if choose is not None else RoundRobin())
        self.routing: Routing = routing
        self._trace: Iterator[tuple[int, TraceRequest]] = iter(())
        self._more = False
        """An arrival is scheduled and not yet delivered."""
        self.live = 0
        """Requests arrived and not yet finished, refused or failed."""
        self.failed = 0
        """Requests that ended in an error (no replica, retries spent, lost mid-stream)."""
        self._requests: dict[int, tuple[tuple[int, ...], int]] = {}
        self._lost: dict[int, tuple[int, Lost]] = {}
        """Requests lost in a crash and not yet retried or failed: their replica and state."""
        self._sent: dict[int, tuple[int, ...]] = {}
        """Tokens a resumed stream's client has (every attempt's before the one now)."""
        self.resumed = 0
        """Streams resumed on another replica after a crash (the client saw no error)."""
        self.resume_prefill_tokens = 0
        """Prompt tokens re-sent by those resumes: the prompt plus what had been generated
        (the prefix cache of the replica they went to may serve part of it)."""
        """Prompt and output length of each request inside a replica (to retry it)."""
        self.gate: Gate | None = None
        """Admission in front of routing (None: every arrival is routed at once)."""

    @property
    def active(self) -> bool:
        """Arrivals are still to come or requests are in the replicas."""
        return self._more or self.live > 0

    def start(self, trace: Iterable[TraceRequest]) -> None:
        """Schedule the trace's arrivals (lazily: one pending at a time)."""
        self._trace = enumerate(trace)
        self.kernel.schedule_all(self._next_arrival())

    def every(self, interval: float, callback: Callable[[float], None]) -> None:
        """Call ``callback(now)`` now and every ``interval`` seconds while :attr:`active`.

        Call it after :meth:`start`. Ticks are shared events (the callback may read every
        replica) at ``now + k × interval`` (no accumulated rounding); they come before the
        replicas' steps of the same instant.
        """
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval}")
        now = self.kernel.now
        self.kernel.schedule(now, TICK_PRIORITY, Tick(self, now, interval, 0, callback))

    def run(self, until: float | None = None) -> None:
        self.kernel.run(until)

    def add_replica(self, model: ReplicaModel) -> int:
        """A new replica joins the fleet (an autoscaler's scale-out): its driver's index.

        Call it from a shared event. Drivers are never removed (the recorder's rows name
        them by index); a replica that leaves simply gets no more requests.
        """
        index = len(self.drivers)
        self.drivers.append(
            ReplicaDriver(
                index,
                model,
                self.recorder,
                horizon=self._horizon,
                on_end=self._ended,
                kernel=self.kernel,
                defer=self._defer,
            )
        )
        self.drivers[index].on_kv = self.kv_hook
        return index

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        if isinstance(event, Tick):
            event.callback(now)
            if not self.active:
                return []
            count = event.count + 1
            then = event.start + count * event.interval
            return [
                ScheduledEvent(
                    then,
                    TICK_PRIORITY,
                    Tick(self, event.start, event.interval, count, event.callback),
                )
            ]
        assert isinstance(event, Arrival), event
        self._more = False
        index, request = event.index, event.request
        drivers = self.drivers
        prompt = self.prompts.prompt(index, request)
        self.live += 1
        gate = self.gate
        if gate is not None:
            return gate.arrive(now, index, request, prompt) + self._next_arrival()
        chosen = self.routing.route(now, index, request, prompt, drivers)
        if chosen is None:  # no replica can take it: the gateway's 503
            self._fail(now, index, None, now, None, len(prompt))
            return self._next_arrival()
        self._requests[index] = (prompt, request.output_tokens)
        return drivers[chosen].submit(now, index, self._new(index)) + self._next_arrival()

    def submit_new(  # noqa: PLR0917 - the request and where it goes
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replica: int,
        priority: int = 0,
    ) -> list[ScheduledEvent]:
        """Send request ``index`` to driver ``replica`` now (a gate let it start; its
        latencies count from its arrival), with the engine ``priority`` the gateway would
        send it with. Call it from a shared event."""
        self._requests[index] = (prompt, request.output_tokens)
        new = self._new(index, priority)
        return self.drivers[replica].submit(now, index, new, request.arrival_s)

    def submit_retry(
        self, now: float, index: int, replica: int, priority: int = 0
    ) -> list[ScheduledEvent]:
        """Send request ``index``, lost in a crash (or recalled), to driver ``replica``."""
        _, state = self._lost.pop(index)
        return self.drivers[replica].submit(now, index, self._new(index, priority), state.arrival)

    def submit_resume(self, now: float, index: int, replica: int) -> list[ScheduledEvent]:
        """Resume request ``index``'s stream, lost in a crash after its first token, on
        driver ``replica`` (from ``on_lost``): the prompt plus every token generated so far,
        for the tokens still to come, going on with the same answer (the gateway's splice)."""
        _, state = self._lost.pop(index)
        prompt, output_tokens = self._requests[index]
        first, last = state.first_token, state.last_token
        assert first is not None, "a resume needs a started stream"
        assert last is not None
        sent = self._sent[index] = self._sent.get(index, ()) + state.generated
        request = NewRequest(
            str(index),
            prompt + sent,
            output_tokens - len(sent),
            ignore_eos=True,
            continues_at=state.continues_at,
        )
        self.resumed += 1
        self.resume_prefill_tokens += len(request.prompt_token_ids)
        resume = Resume(first, last, len(sent), len(prompt))
        return self.drivers[replica].submit(now, index, request, state.arrival, resume)

    def refused(
        self,
        now: float,
        index: int,
        replica: int,
        request: TraceRequest | None = None,
        prompt: tuple[int, ...] = (),
    ) -> list[ScheduledEvent]:
        """Driver ``replica`` is down (it crashed this instant; the controller has not heard
        yet) and request ``index`` was sent there: refused, as a connection to a dead process
        is, and lost again (retried, resumed or failed by ``on_lost``). ``request`` and
        ``prompt``: its first attempt's; else it was lost before and is in ``_lost``."""
        if request is not None:
            self._requests[index] = (prompt, request.output_tokens)
            state = Lost(index, request.arrival_s, None, len(prompt))
        else:
            _, state = self._lost.pop(index)
        return self.lose(now, replica, [state])

    def refuse(self, now: float, index: int, request: TraceRequest, input_tokens: int) -> None:
        """A gate refuses request ``index`` (shed, or its deadline passed): an error row."""
        self._fail(now, index, None, request.arrival_s, None, input_tokens)

    def fail_lost(self, now: float, index: int) -> None:
        """Request ``index``, lost in a crash, ends in an error (from ``on_lost``)."""
        replica, state = self._lost.pop(index)
        self._fail(now, index, replica, state.arrival, state.first_token, 0)

    def lose(
        self,
        now: float,
        replica: int,
        lost: Sequence[Lost],
        outcome: Outcome = Outcome.CONNECT_FAILURE,
        *,
        kept: bool = False,
    ) -> list[ScheduledEvent]:
        """Requests lost in a crash of ``replica`` (or abandoned there: ``outcome``): each
        retried elsewhere, or an error. ``kept``: the controller keeps them for a later
        attempt (recalled batch lines wait at its gate): one not routed at once waits for its
        Route, or the Reject that fails it.

        Call it from a shared event (a fault, a controller command) at ``now``.
        """
        events: list[ScheduledEvent] = []
        for state in lost:
            self._lost[state.index] = (replica, state)
            started = state.first_token is not None
            events += self.routing.on_lost(now, state.index, replica, started, outcome)
            if not kept and state.index in self._lost:  # neither retried nor failed: an error
                self.fail_lost(now, state.index)
        return events

    def _new(self, index: int, priority: int = 0) -> NewRequest:
        prompt, output_tokens = self._requests[index]
        return NewRequest(
            str(index),
            prompt,
            output_tokens,
            ignore_eos=True,  # the trace says how many tokens came out
            priority=priority,
        )

    def _fail(  # noqa: PLR0917 - one row's fields
        self,
        now: float,
        index: int,
        replica: int | None,
        arrival: float,
        first: float | None,
        input_tokens: int,
    ) -> None:
        """Request ``index`` ends in an error at ``now`` (``replica``: where it last was)."""
        prompt = self._requests.pop(index, None)
        self._sent.pop(index, None)
        if prompt is not None:
            input_tokens = len(prompt[0])
        self.recorder.log.append(
            RequestRecord(
                index,
                -1 if replica is None else replica,
                arrival,
                first,
                now,
                input_tokens,
                0,
                0,
                False,
                True,
            )
        )
        self.live -= 1
        self.failed += 1

    def _ended(self, now: float, index: int, replica: int, rejected: bool) -> None:
        self.live -= 1
        self._requests.pop(index, None)
        self._sent.pop(index, None)
        self.routing.on_end(now, index, replica, rejected)

    def _next_arrival(self) -> list[ScheduledEvent]:
        following = next(self._trace, None)
        if following is None:
            return []
        self._more = True
        index, request = following
        return [ScheduledEvent(request.arrival_s, ARRIVAL_PRIORITY, Arrival(self, index, request))]
