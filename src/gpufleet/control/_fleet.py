"""Every pool's controller behind one entry point, and the event log both clocks share.

::

    control = FleetController.of(load_fleet(path), admission=True)
    commands = control.handle(now, event)      # dispatched to the event's pool (Tick: all)
    control.next_wakeup()
    control.log = DecisionLog(open("run.jsonl", "w"))   # record: every event, its commands

It owns the served names (``gpufleet.control._served``): an ``Arrived`` names what the
client sent; the controller chooses the variant (pool) and, when that pool rejects the
request (or cannot hold its prompt), the next name of its ``fallbacks``.

A recording is JSON lines: a header (the fleet file as JSON, the seed, the admission and
autoscale switches, so a replay needs nothing else), then one line per event::

    {"t": 12.5, "event": {"kind": "arrived", ...}, "commands": [{"do": "route", ...}]}

:func:`replay` feeds a recording's events to a fresh controller and yields each line's
commands, which must equal the recorded ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import IO, Any, Final

from gpufleet.config import FleetConfig
from gpufleet.control._events import (
    AdapterAdded,
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Event,
    Fallback,
    FallbackReason,
    Finished,
    Latencies,
    Reject,
    RejectReason,
    RolloutAct,
    RolloutStart,
    Route,
    Tick,
    Weights,
    command_to_json,
    event_from_json,
    event_to_json,
)
from gpufleet.control._pool import PoolController
from gpufleet.control._residency import ResidencyControl
from gpufleet.control._residency_events import Resident
from gpufleet.control._rollouts import Rollouts
from gpufleet.control._served import (
    Flight,
    ServedModel,
    choose,
    in_pool,
    route_in,
    served_models,
    within_budget,
)
from gpufleet.control._settings import PoolSettings

RECORDING_VERSION: Final = 1


class DecisionLog:
    """Writes one JSON line per event handled: the time, the event, its commands."""

    __slots__ = ("_out",)

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def header(
        self,
        fleet: FleetConfig,
        *,
        seed: int,
        admission: bool,
        autoscale: bool,
        autoscale_interval: float,
        prefill_s: Mapping[str, float] | None = None,
    ) -> None:
        head = {
            "gpufleet_recording": RECORDING_VERSION,
            "seed": seed,
            "admission": admission,
            "autoscale": autoscale,
            "autoscale_interval": autoscale_interval,
            "fleet": fleet.model_dump(mode="json"),
        }
        if prefill_s:  # absent: no latency-budget predictions (and recordings made before)
            head["prefill_s"] = dict(prefill_s)
        self._out.write(json.dumps(head) + "\n")

    def write(self, now: float, event: Event, commands: list[Command]) -> None:
        line = {
            "t": now,
            "event": event_to_json(event),
            "commands": [command_to_json(c) for c in commands],
        }
        self._out.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        self._out.flush()


@dataclass(frozen=True, slots=True)
class QueueReport:
    """A pool's admission queue as a report shows it: numbers read from the controller's
    gate (the shells never build one of their own)."""

    max_num_seqs: int
    """The running-batch cap the pool's saturation is judged by."""
    queue_max: int
    """The longest the queue has been."""
    counters: Mapping[str, float]
    """Per tenant: its virtual token counter (the fair share's weighted tokens)."""


_REQUEST_EVENTS: Final = (AttemptFailed, Finished, ClientGone)
_ROLLOUT_EVENTS: Final = (Latencies, RolloutStart, RolloutAct)
_FLEET_EVENTS: Final = (Tick, *_ROLLOUT_EVENTS, Weights, Resident, AdapterAdded)
"""Events of no one pool (the rest go to the pool they name)."""


class FleetController:
    """One :class:`PoolController` per model pool, in the fleet file's order, and the
    served names over them."""

    __slots__ = (
        "_contexts",
        "_flights",
        "_prices",
        "fallbacks",
        "fleet",
        "log",
        "pools",
        "prefill_s",
        "residency",
        "rollouts",
        "seed",
        "served",
        "touched",
    )

    def __init__(
        self,
        fleet: FleetConfig,
        pools: Mapping[str, PoolController],
        seed: int,
        prefill_s: Mapping[str, float] | None = None,
    ) -> None:
        self.fleet = fleet
        self.pools = dict(pools)
        self.seed = seed
        self.prefill_s = dict(prefill_s or {})
        """Per pool, the performance model's seconds per prompt token of a prefill on one of
        its replicas (a shell computes them: ``control`` reads no performance model). With
        them a request with a latency budget is placed by predicted TTFT."""
        self._prices = {m.name: m.usd_per_gpu_hour() * m.tp for m in fleet.models}
        """Per pool, what one replica costs, in dollars per hour (its GPUs' price × TP)."""
        self.log: DecisionLog | None = None
        """Where every event and its commands go (``--record``), or ``None``."""
        settings = {name: pool.settings for name, pool in self.pools.items()}
        self.served: dict[str, ServedModel] = served_models(fleet, settings)
        """Every name clients may send as ``model``, in ``FleetConfig.served_names`` order."""
        self.fallbacks: dict[tuple[str, str, str], int] = {}
        """Fallbacks taken, per (from, to, reason)."""
        self.touched: str | None = None
        """The one pool the last event reached (``None``: several, or any: a Tick, a
        request that moved to a fallback's pool): where the shell looks for a changed view."""
        self._contexts = {name: s.context for name, s in settings.items()}
        self._flights: dict[str, Flight] = {}
        """The requests of names that are not plain, by id, until they end."""
        self.rollouts = Rollouts(self.served)
        """The served names' rollouts (``control/_rollouts.py``)."""
        self.residency = ResidencyControl.of(fleet, self.pools)
        """Sleep and wake of the pools that are not always resident (``None``: none is)."""

    @classmethod
    def of(
        cls,
        fleet: FleetConfig,
        *,
        seed: int | None = None,
        admission: bool | None = None,
        autoscale: bool = True,
        autoscale_interval: float | None = None,
        prefill_s: Mapping[str, float] | None = None,
    ) -> FleetController:
        pools = {
            m.name: PoolController(
                PoolSettings.of(
                    fleet,
                    m,
                    seed=seed,
                    admission=admission,
                    autoscale=autoscale,
                    autoscale_interval=autoscale_interval,
                )
            )
            for m in fleet.models
        }
        return cls(fleet, pools, fleet.gateway.seed if seed is None else seed, prefill_s)

    @property
    def admission(self) -> bool:
        return any(p.admission is not None for p in self.pools.values())

    @property
    def times_first_tokens(self) -> bool:
        """Whether the shells tell each answered request's TTFT in ``Finished.ttft``: the
        batch gate reads it (``gateway.batch.spare.ttft_margin`` or ``ttft_p99``)."""
        return any(p.spare is not None and p.spare.guard is not None for p in self.pools.values())

    @property
    def autoscale(self) -> bool:
        """Whether scaling decisions are made (the fleet file's ``autoscale`` pools, unless
        built with ``autoscale=False``)."""
        return all(
            (p.autoscaler is not None) == (m.autoscale is not None)
            for p, m in zip(self.pools.values(), self.fleet.models, strict=True)
        )

    def record(self, out: IO[str]) -> None:
        """Write every event from now on to ``out`` (after a header)."""
        log = DecisionLog(out)
        first = next(iter(self.pools.values()), None)  # every pool is built with one interval
        log.header(
            self.fleet,
            seed=self.seed,
            admission=self.admission,
            autoscale=self.autoscale,
            autoscale_interval=1.0 if first is None else first.settings.autoscale_interval,
            prefill_s=self.prefill_s,
        )
        self.log = log

    def handle(self, now: float, event: Event) -> list[Command]:
        followed = False
        if isinstance(event, Arrived):
            commands, followed = self._arrived(now, event)
        elif not isinstance(event, _FLEET_EVENTS) and not (
            self._flights and isinstance(event, _REQUEST_EVENTS)
        ):  # a pool's own event (most: a request's end, a scrape)
            self.touched = event.model
            pool = self.pools.get(event.model)
            commands = [] if pool is None else pool.handle(now, event)
        elif isinstance(event, _REQUEST_EVENTS):  # of a request in a flight
            event, commands = self._request_event(now, event)
        elif isinstance(event, Tick):
            commands = self._tick(now, event)
        elif isinstance(event, _ROLLOUT_EVENTS):
            self.touched = None
            commands = self._rollout(now, event)
        elif isinstance(event, Weights):
            self.touched = None
            self._reweigh(event)
            commands = []
        elif isinstance(event, AdapterAdded):
            self.touched = None
            self._add_adapter(event)
            commands = []
        else:  # Resident
            commands = []  # residency's own (below)
        if self._flights and commands and not followed:
            commands = self._follow(now, commands)
        if self.residency is not None:
            commands = self._reside(now, event, commands)
        if self.log is not None:
            self.log.write(now, event, commands)
        return commands

    def _tick(self, now: float, tick: Tick) -> list[Command]:
        """The pools and rollouts that are due."""
        self.touched = None
        commands: list[Command] = []
        for due in self.pools.values():
            wake = due.next_wakeup()
            if wake is not None and now >= wake:
                commands += due.handle(now, tick)
        wake = self.rollouts.next_wakeup()
        if wake is not None and now >= wake:
            commands += self.rollouts.due(now, self._ready())
        return commands

    def _reside(self, now: float, event: Event, commands: list[Command]) -> list[Command]:
        """What residency adds after the pools took ``event`` (its commands followed, as
        the pools' are: a held request it routes may be in a flight)."""
        residency = self.residency
        assert residency is not None
        arrived_in = None
        if isinstance(event, Arrived):
            rid = event.request.request_id
            flight = self._flights.get(rid)
            arrived_in = event.request.model if flight is None else flight.pool
        extra = residency.after(now, event, arrived_in)
        self.touched = None  # residency may change any of its pools, and its own wake-up
        if not extra:
            return commands
        if self._flights:
            extra = self._follow(now, extra)
        return [*commands, *extra]

    def _arrived(self, now: float, event: Arrived) -> tuple[list[Command], bool]:
        """A request arrives at its served name: its commands, and whether they were
        followed already (a name that is not plain: by :meth:`_enter`)."""
        name = event.request.model
        served = self.served.get(name)
        if served is None:
            raise ValueError(f"no served model {name!r} (served: {', '.join(self.served)})")
        if served.plain:
            self.touched = name
            return self.pools[name].handle(now, event), False
        flight = Flight(event, served.reach)
        self._flights[event.request.request_id] = flight
        served.arrived += 1
        out: list[Command] = []
        self._enter(now, flight, None, out)
        # one pool's view can have changed, unless it moved on (or skipped a name)
        self.touched = flight.pool if flight.step == 0 and len(flight.tried) == 1 else None
        return out, True

    def _request_event(
        self, now: float, event: AttemptFailed | Finished | ClientGone
    ) -> tuple[Event, list[Command]]:
        """A request's event while some requests are in flights: to the pool it is in (the
        event as logged, and its commands)."""
        flight = self._flights.get(event.request_id)
        if flight is not None and event.model != flight.pool:
            event = replace(event, model=flight.pool)  # the shell may name the served name
        self.touched = event.model
        pool = self.pools.get(event.model)
        commands = [] if pool is None else pool.handle(now, event)
        if self.rollouts.watched and not isinstance(event, ClientGone):
            self.rollouts.outcome(now, event)
        if flight is not None and not isinstance(event, AttemptFailed):
            del self._flights[event.request_id]  # it ended (answered, or its client left)
        return event, commands

    # -- served names -----------------------------------------------------------------------

    def _enter(self, now: float, flight: Flight, reason: str | None, out: list[Command]) -> bool:
        """Send ``flight`` into the next step of its chain that has a variant for it (the
        first, at its arrival; after a Reject for ``reason``, the next); whether one had.
        What that pool answers is followed into ``out`` (it may reject it at once)."""
        chain = self.served[flight.arrived.request.model].chain
        for step in range(flight.step + 1, len(chain)):
            served = self.served[chain[step]]
            pool = choose(
                served, flight, self._contexts, self._budgeted if self.prefill_s else None
            )
            if pool is None:  # none it has not tried holds its prompt
                continue
            if step == 0:  # its name's own split (not a fallback's, not a second try)
                served.chosen[pool] = served.chosen.get(pool, 0) + 1
            arrived = flight.arrived
            request = arrived.request
            if step > 0:  # it leaves the name it is in (at its arrival: none held the prompt)
                why = reason or FallbackReason.CONTEXT
                out.append(Fallback(request.request_id, flight.name, served.name, pool, why))
                key = (flight.name, served.name, why)
                self.fallbacks[key] = self.fallbacks.get(key, 0) + 1
            flight.step, flight.name, flight.pool = step, served.name, pool
            flight.tried.append(pool)
            if request.model != pool:
                arrived = in_pool(arrived, pool, served.name if served.adapter else None)
            out.extend(self._follow(now, self.pools[pool].handle(now, arrived)))
            return True
        return False

    def _budgeted(self, candidates: list[tuple[str, float]], flight: Flight) -> str | None:
        """A request with a latency budget: the variant on the cheapest replicas predicted
        to meet it (``within_budget``)."""
        budget = flight.arrived.budget
        assert budget is not None
        tokens = flight.arrived.request.prompt_tokens
        prices = self._prices
        return within_budget(
            candidates, budget, lambda pool: self.predict_ttft(pool, tokens), prices.__getitem__
        )

    def predict_ttft(self, pool: str, tokens: int) -> float:
        """Seconds to the first token of a ``tokens``-token prompt sent to ``pool`` now: its
        prefill on one replica (the performance model's), stretched by how full the pool's
        slots are (a request past them waits its turn); ``inf``: no replica to run it, or
        no model of the pool."""
        rate = self.prefill_s.get(pool)
        controller = self.pools.get(pool)
        if rate is None or controller is None:
            return math.inf
        slots = len(controller.routable()) * controller.settings.max_num_seqs
        if slots == 0:
            return math.inf
        return rate * max(tokens, 1) * max(1.0, (controller.in_flight + 1) / slots)

    def _follow(self, now: float, commands: list[Command]) -> list[Command]:
        """Commands of requests in flights: each Route and final Reject names its pool; a
        Reject that is not final (not ``broken``, a fallback left) becomes the fallback."""
        flights = self._flights
        out: list[Command] = []
        for command in commands:
            if isinstance(command, Route):
                flight = flights.get(command.request_id)
                out.append(command if flight is None else route_in(command, flight.pool))
            elif isinstance(command, Reject) and (flight := flights.get(command.request_id)):
                if command.reason != RejectReason.BROKEN and self._enter(
                    now, flight, command.reason, out
                ):
                    self.touched = None  # it moved to another pool
                else:
                    del flights[command.request_id]  # its last word
                    out.append(
                        Reject(command.request_id, command.reason, command.budget, flight.pool)
                    )
            else:
                out.append(command)
        return out

    def _rollout(self, now: float, event: Latencies | RolloutStart | RolloutAct) -> list[Command]:
        rollouts = self.rollouts
        if isinstance(event, Latencies):
            rollouts.latencies(now, event)
            return []
        if isinstance(event, RolloutStart):
            return rollouts.start(now, event, self._ready())
        return rollouts.act(now, event)

    def _add_adapter(self, event: AdapterAdded) -> None:
        """A LoRA adapter registered at run time becomes a served name over its pool
        (``ValueError``: the pool serves no adapters, the name is taken, the rank too big)."""
        pool = self.pools.get(event.model)
        if pool is None or pool.adapters is None:
            raise ValueError(f"adapters: pool {event.model!r} has no `lora` block")
        if event.name in self.served:
            raise ValueError(f"adapters: {event.name!r} is already a served name")
        config = pool.adapters.config
        if not 1 <= event.rank <= config.max_lora_rank:
            raise ValueError(
                f"adapters: rank {event.rank} is not within 1..{config.max_lora_rank} "
                "(the pool's max_lora_rank)"
            )
        settings = pool.settings
        self.served[event.name] = ServedModel(
            event.name,
            [(event.model, 1.0)],
            (),
            hashes=settings.hashes,
            plain=False,
            reach=settings.context,
            adapter=True,
        )
        pool.adapters.registered[event.name] = event.path

    def _reweigh(self, event: Weights) -> None:
        served = self.served.get(event.model)
        if served is None:
            raise ValueError(f"weights: no served model {event.model!r}")
        served.reweigh(event.weights)

    def next_wakeup(self) -> float | None:
        due = self.rollouts.next_wakeup()
        if self.residency is not None:
            t = self.residency.next_wakeup()
            if t is not None and (due is None or t < due):
                due = t
        for pool in self.pools.values():
            t = pool.next_wakeup()
            if t is not None and (due is None or t < due):
                due = t
        return due

    def _ready(self) -> dict[str, int]:
        """Routable replicas per pool (a blue-green rollout switches on them)."""
        return {name: len(pool.routable()) for name, pool in self.pools.items()}

    def fleet_rollouts(self) -> list[RolloutStart]:
        """The fleet file's ``rollout`` blocks as the events that start them: a shell hands
        them to :meth:`handle` when it starts (the gateway: unless its store has the name's
        rollout from before a restart)."""
        return [
            RolloutStart(entry.name, entry.rollout)
            for entry in self.fleet.served
            if entry.rollout is not None
        ]

    def queues(self) -> dict[str, QueueReport]:
        """Each pool's admission queue, read-only; a pool without admission reads as an
        empty queue at its ``max_num_seqs``."""
        out: dict[str, QueueReport] = {}
        for name, pool in self.pools.items():
            gate = pool.admission
            out[name] = (
                QueueReport(pool.settings.max_num_seqs, 0, {})
                if gate is None
                else QueueReport(gate.gauge.max_num_seqs, gate.queue_max, dict(gate.queue.counters))
            )
        return out


@dataclass(frozen=True, slots=True)
class Recorded:
    """One line of a recording."""

    t: float
    event: Event
    commands: list[dict[str, Any]]


def read_recording(lines: Iterable[str]) -> tuple[dict[str, Any], Iterator[Recorded]]:
    """A recording's header and its lines (``ValueError`` for a file that is not one)."""
    it = iter(lines)
    first = next(it, None)
    try:
        head = json.loads(first) if first is not None else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("gpufleet_recording") != RECORDING_VERSION:
        raise ValueError("not a gpufleet recording (no header line; record with --record)")

    def body() -> Iterator[Recorded]:
        for n, line in enumerate(it, start=2):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                yield Recorded(float(data["t"]), event_from_json(data["event"]), data["commands"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"line {n}: {error}") from None

    return head, body()


def replay(
    head: dict[str, Any], lines: Iterable[Recorded], fleet: FleetConfig | None = None
) -> Iterator[tuple[Recorded, list[dict[str, Any]]]]:
    """Feed recorded events to a fresh controller (of ``fleet``, or the recorded one);
    each line with the commands the controller gives now."""
    if fleet is None:
        fleet = FleetConfig.model_validate(head["fleet"])
    control = FleetController.of(
        fleet,
        seed=int(head["seed"]),
        admission=bool(head["admission"]),
        autoscale=bool(head.get("autoscale", True)),
        autoscale_interval=head.get("autoscale_interval"),
        prefill_s={str(p): float(s) for p, s in (head.get("prefill_s") or {}).items()},
    )
    for line in lines:
        commands = control.handle(line.t, line.event)
        yield line, [command_to_json(c) for c in commands]
