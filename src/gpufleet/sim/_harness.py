"""A minimal fleet: a trace, a few replica drivers and a routing function between them.

    harness = FleetHarness([ReplicaModel(config) for _ in range(8)], prompts, choose=RoundRobin())
    harness.start(load_trace("AzureLLMInferenceTrace_conv.csv"))
    harness.run()                     # or run(until=t) in slices, to show progress
    harness.recorder.log              # one row per request

Arrivals are fed one at a time: the harness holds the next trace request and schedules its
arrival when the previous one is delivered, so the trace is never in memory::

    Arrival(i) @ t_i ─► choose(now, request, drivers) ─► drivers[k].submit(...)
                    └─► next(trace) ─► Arrival(i + 1) @ t_(i+1)

``choose`` is the seam where the policy routers plug in next: any callable
``choose(now, request, replicas) -> index``. Round robin is the default.

Arrivals are the kernel's shared events (a router may read every replica); the replicas'
steps are local to them. So between two arrivals each replica may fast-forward its runs of
pure-decode steps (``fast_forward=True``, the default); ``fast_forward=False`` steps one
kernel event at a time, with byte-identical results (``Recorder.digest()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from gpufleet.engine.model import NewRequest, ReplicaModel
from gpufleet.sim._kernel import URGENT, Event, Kernel, ScheduledEvent
from gpufleet.sim._prompts import PromptBuilder
from gpufleet.sim._recorder import Recorder
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._traces import TraceRequest

ARRIVAL_PRIORITY = URGENT
"""Arrivals come before the steps of the same instant (they join the step planned then)."""

Chooser = Callable[[float, TraceRequest, Sequence[ReplicaDriver]], int]
"""``choose(now, request, replicas) -> index``: which replica serves a request."""


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


class FleetHarness:
    """Replica drivers on one kernel, fed by a trace through a routing function."""

    __slots__ = ("_trace", "choose", "drivers", "kernel", "prompts", "recorder")

    def __init__(
        self,
        replicas: Sequence[ReplicaModel],
        prompts: PromptBuilder,
        *,
        choose: Chooser | None = None,
        kernel: Kernel | None = None,
        recorder: Recorder | None = None,
        fast_forward: bool = True,
    ) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.kernel = kernel if kernel is not None else Kernel()
        self.recorder = recorder if recorder is not None else Recorder()
        horizon = self.kernel.next_shared if fast_forward else None
        self.drivers = [
            ReplicaDriver(i, m, self.recorder, horizon=horizon) for i, m in enumerate(replicas)
        ]
        self.prompts = prompts
        self.choose: Chooser = choose if choose is not None else RoundRobin()
        self._trace: Iterator[tuple[int, TraceRequest]] = iter(())

    def start(self, trace: Iterable[TraceRequest]) -> None:
        """Schedule the trace's arrivals (lazily: one pending at a time)."""
        self._trace = enumerate(trace)
        self.kernel.schedule_all(self._next_arrival())

    def run(self, until: float | None = None) -> None:
        self.kernel.run(until)

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, Arrival), event
        request = event.request
        drivers = self.drivers
        chosen = self.choose(now, request, drivers)
        new = NewRequest(
            str(event.index),
            self.prompts.prompt(event.index, request),
            request.output_tokens,
            ignore_eos=True,  # the trace says how many tokens came out
        )
        return drivers[chosen].submit(now, event.index, new) + self._next_arrival()

    def _next_arrival(self) -> list[ScheduledEvent]:
        following = next(self._trace, None)
        if following is None:
            return []
        index, request = following
        return [ScheduledEvent(request.arrival_s, ARRIVAL_PRIORITY, Arrival(self, index, request))]
