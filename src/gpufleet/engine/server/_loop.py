"""The real-time shell around the replica model: plan a step, wait it out, hand out tokens.

The model decides; this loop only waits and dispatches (STYLE 4)::

    t ──plan_step(t)──► plan ──sleep until t + plan.duration──► finish_step(plan, t_end)
                                                                   │
                                 outputs ──► one RequestStream per request (wakes its handler)

Time is *modelled* time from a ``Clock``. The loop keeps the modelled timeline exact: a step
starts where the previous one ended (``t = t_end``), however late the event loop woke, and it
wakes a learned ~0.3 ms early to cancel timer lateness on average, so timer granularity never
accumulates into token timing. Only a wake later than ``slack`` (CPU overload) re-anchors the
timeline on the clock; that lag is counted (``gpufleet:sim_engine_lag_seconds_total``)
because it is real. Arrival stamps come from the clock and never move the timeline.

Handlers never touch the model: they ``submit`` a request, read their stream and ``abort``
on disconnect. ``add_request`` and ``abort`` may land between a step's plan and its finish,
as the replica model allows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpufleet.engine.model import KvCacheEvent, NewRequest, ReplicaModel, RequestOutput
from gpufleet.engine.server._clock import Clock
from gpufleet.engine.server._metrics import EngineMetrics

logger = logging.getLogger("gpufleet.engine.sim")

DEFAULT_SLACK_REAL_S = 0.003
"""How far (real seconds) the loop may run behind the modelled timeline before re-anchoring."""


_AIM_GAIN = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


@dataclass(slots=True, eq=False)
class RequestStream:
    """The outputs of one request, as the loop hands them out."""

    request_id: str
    arrival: float
    """Modelled time the request reached the model."""
    outputs: list[RequestOutput] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    """No more outputs will come: finished, aborted, or the engine stopped."""
    error: BaseException | None = None
    last_token_at: float | None = None
    first_token_at: float | None = None
    """Modelled time of its first output (a trace's time to first token)."""

    async def next(self) -> list[RequestOutput]:
        """Wait for outputs; an empty list means the stream closed without finishing."""
        if not self.outputs and not self.closed:
            await self.ready.wait()
        self.ready.clear()
        outputs, self.outputs = self.outputs, []
        if not outputs and self.error is not None:
            raise EngineDeadError(str(self.error)) from self.error
        return outputs

    def _close(self, error: BaseException | None = None) -> None:
        self.closed = True
        self.error = error
        self.ready.set()


class EngineLoop:
    """Drives one ``ReplicaModel`` in real (scaled) time; owns the per-request streams."""

    def __init__(
        self,
        model: ReplicaModel,
        clock: Clock,
        metrics: EngineMetrics,
        slack_real_s: float = DEFAULT_SLACK_REAL_S,
        publish: Callable[[Sequence[KvCacheEvent]], None] | None = None,
    ) -> None:
        self._model = model
        self._publish = publish
        """Where a step's KV events go (``--kv-events-config``), or ``None``."""
        self._clock = clock
        self._metrics = metrics
        self._slack = slack_real_s * clock.time_scale
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._t = clock.now()
        """The loop's modelled timeline: where the last step started or ended."""
        self._early = 0.0
        """How much earlier than a step's end the loop wakes (modelled seconds; see _aim)."""
        self.dead: BaseException | None = None

    @property
    def model(self) -> ReplicaModel:
        return self._model

    def now(self) -> float:
        """Modelled time for an event arriving now: an arrival stamp.

        Stamps never move the loop's timeline: a request that lands while a step's tokens
        are being handed out still joins the step that starts at the previous one's end.
        """
        return self._clock.now()

    def submit(self, request: NewRequest) -> RequestStream:
        """Queue a request; ``ValueError`` (the model's message) when it cannot be served."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.dead!r}")
        now = self.now()
        self._model.add_request(request, now)
        stream = RequestStream(request.request_id, now)
        self._streams[request.request_id] = stream
        self._wakeup.set()
        return stream

    def serving(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (not finished, aborted or unknown)."""
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        """Drop a request at once (client gone, stop string): its blocks are freed now."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._close()
        if self.dead is None:
            self._model.abort(request_id, self.now())
        self._wakeup.set()

    def abort_all(self) -> int:
        """Abort every request (vLLM's ``POST /sleep`` with its default ``mode=abort``); how
        many there were."""
        ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    async def run(self, started: asyncio.Event) -> None:
        """Step the model until cancelled; an error in the model closes every stream."""
        started.set()
        try:
            await self._run()
        except Exception as error:  # a bug in the model: fail loudly, keep answering
            logger.exception("sim engine loop stopped")
            self.dead = error
            self._close_all(error)
        finally:
            self._close_all(None)

    async def _run(self) -> None:
        model, clock = self._model, self._clock
        idle = True
        while True:
            start = self._start_time(idle)
            plan = model.plan_step(start)
            if plan is None:
                idle = True
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            idle = False
            end = start + plan.duration
            self._metrics.activity.record(start, end, plan.timing)
            await clock.sleep_until(end - self._early)
            self._t = max(self._t, self._woke(end))
            self._dispatch(model.finish_step(plan, end), end)
            if self._publish is not None and (events := model.take_kv_events()):
                self._publish(events)  # before the handlers write: events lead the answer
            # Let the woken handlers write before the next plan is computed.
            await asyncio.sleep(0)

    def _woke(self, end: float) -> float:
        """Where the next step starts, given how late the loop woke for the one ending at ``end``.

        Timers fire a little late: the loop learns by how much and wakes that much early
        (``_early`` follows the mean lateness, capped at ``slack``), so tokens are on time on
        average without spinning the CPU. A wake later than ``slack`` is real lag (CPU
        overload): it is counted, and the timeline re-anchors on the clock.
        """
        late = self._clock.now() - end
        self._early = min(self._slack, max(0.0, self._early + _AIM_GAIN * late))
        if late > self._slack:
            self._metrics.shell.lag_seconds += late / self._clock.time_scale
            return end + late
        return end

    def _start_time(self, idle: bool) -> float:
        """The next step starts where the last one ended, or now after an idle wait."""
        if idle:
            self._t = max(self._t, self._clock.now())
        return self._t

    def _dispatch(self, outputs: list[RequestOutput], end: float) -> None:
        streams = self._streams
        metrics = self._metrics
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:  # aborted between plan and finish
                continue
            if stream.first_token_at is None:
                stream.first_token_at = end
            if output.new_token_ids:
                if stream.last_token_at is None:
                    metrics.observe_ttft(max(0.0, end - stream.arrival))
                else:
                    metrics.observe_itl(end - stream.last_token_at)
                stream.last_token_at = end
            elif stream.last_token_at is None:  # a pooling request's one output: vLLM
                metrics.observe_ttft(max(0.0, end - stream.arrival))  # times it as a first token
            stream.outputs.append(output)
            if output.finish_reason is not None:
                metrics.observe_e2e(max(0.0, end - stream.arrival))
                del streams[output.request_id]
                stream.closed = True
            stream.ready.set()

    def _close_all(self, error: BaseException | None) -> None:
        for stream in self._streams.values():
            stream._close(error)
        self._streams.clear()
