"""Every pool's controller behind one entry point, and the event log both clocks share.

::

    control = FleetController.of(load_fleet(path), admission=True)
    commands = control.handle(now, event)      # dispatched to the event's pool (Tick: all)
    control.next_wakeup()
    control.log = DecisionLog(open("run.jsonl", "w"))   # record: every event, its commands

A recording is JSON lines: a header (the fleet file as JSON, the seed, the admission and
autoscale switches, so a replay needs nothing else), then one line per event::

    {"t": 12.5, "event": {"kind": "arrived", ...}, "commands": [{"do": "route", ...}]}

:func:`replay` feeds a recording's events to a fresh controller and yields each line's
commands, which must equal the recorded ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, Final

from gpufleet.config import FleetConfig
from gpufleet.control._events import (
    Arrived,
    Command,
    Event,
    Tick,
    command_to_json,
    event_from_json,
    event_to_json,
)
from gpufleet.control._pool import PoolController
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
    ) -> None:
        head = {
            "gpufleet_recording": RECORDING_VERSION,
            "seed": seed,
            "admission": admission,
            "autoscale": autoscale,
            "autoscale_interval": autoscale_interval,
            "fleet": fleet.model_dump(mode="json"),
        }
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


class FleetController:
    """One :class:`PoolController` per model pool, in the fleet file's order."""

    __slots__ = ("fleet", "log", "pools", "seed")

    def __init__(self, fleet: FleetConfig, pools: Mapping[str, PoolController], seed: int) -> None:
        self.fleet = fleet
        self.pools = dict(pools)
        self.seed = seed
        self.log: DecisionLog | None = None
        """Where every event and its commands go (``--record``), or ``None``."""

    @classmethod
    def of(
        cls,
        fleet: FleetConfig,
        *,
        seed: int | None = None,
        admission: bool | None = None,
        autoscale: bool = True,
        autoscale_interval: float | None = None,
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
        return cls(fleet, pools, fleet.gateway.seed if seed is None else seed)

    @property
    def admission(self) -> bool:
        return any(p.admission is not None for p in self.pools.values())

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
        )
        self.log = log

    def handle(self, now: float, event: Event) -> list[Command]:
        if isinstance(event, Tick):
            commands: list[Command] = []
            for pool in self.pools.values():
                wake = pool.next_wakeup()
                if wake is not None and now >= wake:
                    commands += pool.handle(now, event)
        else:
            model = event.request.model if isinstance(event, Arrived) else event.model
            commands = self.pools[model].handle(now, event)
        if self.log is not None:
            self.log.write(now, event, commands)
        return commands

    def next_wakeup(self) -> float | None:
        due = None
        for pool in self.pools.values():
            t = pool.next_wakeup()
            if t is not None and (due is None or t < due):
                due = t
        return due

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
    )
    for line in lines:
        commands = control.handle(line.t, line.event)
        yield line, [command_to_json(c) for c in commands]
