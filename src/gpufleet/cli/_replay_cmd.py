"""``gpufleet replay``: a recording's events into a fresh pool controller, its decisions out.

    gpufleet simulate --fleet F --trace T --out run --record   # writes run/recording.jsonl
    gpufleet replay run/recording.jsonl                        # same decisions? (exit 1: no)
    gpufleet replay run/recording.jsonl --out decisions.jsonl  # and write them

A recording holds the fleet file it ran with; ``--fleet`` replays the same events under
another one and writes what it would have decided (the outcomes stay the recorded ones: for
a what-if on modelled replicas, give the recording to ``gpufleet simulate --trace``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gpufleet.cli._errors import user_errors
from gpufleet.config import load_fleet
from gpufleet.control import read_recording, replay

_console = Console(stderr=True)


def replay_cmd(
    recording: Annotated[Path, typer.Argument(help="A recording (simulate --record).")],
    fleet: Annotated[
        Path | None, typer.Option(help="Replay under this fleet file instead of the recorded.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the decisions here (JSON lines).")] = None,
) -> None:
    """Feed a recording's events to a fresh controller; check or write its decisions."""
    with user_errors():
        if not recording.is_file():
            raise ValueError(f"{recording}: no such recording")
        other = None if fleet is None else load_fleet(fleet)
        with recording.open(encoding="utf-8") as lines:
            head, body = read_recording(lines)
            events = commands = 0
            first_difference: tuple[int, object, object] | None = None
            sink = None if out is None else out.open("w", encoding="utf-8")
            try:
                for n, (line, decided) in enumerate(replay(head, body, other), start=2):
                    events += 1
                    commands += len(decided)
                    if sink is not None:
                        sink.write(json.dumps({"t": line.t, "commands": decided}) + "\n")
                    if first_difference is None and decided != line.commands:
                        first_difference = (n, line.commands, decided)
            finally:
                if sink is not None:
                    sink.close()
    _console.print(f"{events:,} events replayed, {commands:,} decisions")
    if fleet is not None:
        return
    if first_difference is None:
        _console.print("every decision equals the recorded one")
        return
    n, recorded, now = first_difference
    _console.print(f"line {n}: recorded {recorded}\n        replayed {now}")
    raise typer.Exit(1)
