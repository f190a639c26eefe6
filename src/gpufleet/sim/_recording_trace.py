"""A pool controller's recording read as a trace: a what-if on recorded traffic.

``gpufleet up --record FILE`` (and ``gpufleet simulate --record``) write the controller's
input events as JSON lines (``gpufleet.control``): a header with the fleet file, then one
line per event::

    {"t": 12.5, "event": {"kind": "arrived", "id", "model", "hashes", "prompt_tokens",
                          "session", "tenant", ...}, "commands": [...]}
    {"t": 13.1, "event": {"kind": "finished", "id", "work": [uncached prompt, output]}, ...}

Each ``arrived`` event becomes one request::

    arrival_s      its t − the first arrival's t
    input_tokens   prompt_tokens, the gateway's estimate (characters ÷ 4), at least 1
    output_tokens  work[1] of its ``finished`` event; without one, the recording's median
    hash_ids       its prefix hashes renamed 0, 1, 2 … in order of first appearance,
                   blocks of PREFIX_HASH_TOKENS = 128 tokens (TraceRequest.block_tokens)
    session, model, tenant   as recorded

Why the prefix mapping is faithful: the gateway hashes the prompt text in 512-character
blocks, each hash chained over every block before it, so two prompts have equal hashes at
position i exactly when they agree up to the end of block i. The prompt builder gives a
block id the same ids wherever it appears, so two rebuilt prompts share exactly their common
leading blocks, 128 tokens each (512 characters at the gateway's 4 characters a token, the
same estimate as ``prompt_tokens``), and the simulated router, which hashes blocks of 128
ids, sees the same shared runs the live router saw. Renaming (the hashes are salted per
gateway process, and the prompt builder needs small ids) keeps equality, which is all a hash
means within one recording. What it cannot keep: the text after the last full block (each
request's own ids here, so a repeated prompt shares up to 511 characters less than live).

The output length is on a later line than the arrival, so the file is read twice. The first
pass checks every line and keeps each finished request's output length by id (and the
distribution of answered ones, for the median); the second hands out the arrivals, dropping
an id's entry as its arrival goes. Memory: one entry per finished request after the first
pass, and one per distinct prefix block for the renaming.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.config import FleetConfig
from gpufleet.control import PoolSettings, read_recording

if TYPE_CHECKING:
    from gpufleet.sim._traces import TraceReader, _Row

_ARRIVED = '"arrived"'
"""How an arrival line names its kind: the second pass parses only lines that hold it."""


def recording_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """The recording's arrivals in file order (the order the controller saw them)."""
    outputs, fallback = _outputs(path, reader)
    names: dict[int, int] = {}
    origin: float | None = None
    last = 0.0
    for line, t, event in _events(path, only=_ARRIVED):
        if event["kind"] != "arrived":
            continue
        request_id = _name(path, line, event, "id")
        output = outputs.pop(request_id, None)
        if output is None:
            output = fallback
            reader.estimated += 1
        hashes = _hashes(path, line, event)
        if origin is None:
            origin = last = t
        if t < last:  # said here, in recorded seconds; the pipeline sees them shifted
            raise ValueError(
                f"{path}:{line}: t: {t} s comes before the previous arrival's {last} s; "
                "the recording is out of order"
            )
        last = t
        yield (
            line,
            t - origin,
            max(1, _count(path, line, event, "prompt_tokens")),
            output,
            tuple(names.setdefault(h, len(names)) for h in hashes) or None,
            _text(path, line, event, "session"),
            _name(path, line, event, "model"),
            _text(path, line, event, "tenant"),
        )


def _outputs(path: Path, reader: TraceReader) -> tuple[dict[str, int], int]:
    """First pass: output tokens by request id, and what a request without them gets."""
    outputs: dict[str, int] = {}
    answered: Counter[int] = Counter()
    arrivals = 0
    for line, _, event in _events(path, reader=reader):
        kind = event["kind"]
        if kind == "arrived":
            arrivals += 1
        elif kind == "finished":
            work = event.get("work")
            if work is None:
                continue  # not metered: the gateway knows usage only with tenants on
            if not (
                isinstance(work, list)
                and len(work) == 2
                and all(type(n) is int and n >= 0 for n in work)
            ):
                raise ValueError(
                    f"{path}:{line}: finished.work: expected [uncached prompt tokens, "
                    f"output tokens], got {work!r}"
                )
            if work[1] >= 1:  # 0: the client left before the first token
                outputs[_name(path, line, event, "id")] = work[1]
                if event.get("outcome") == "success":
                    answered[work[1]] += 1
    missing = arrivals - len(outputs)
    if arrivals and not outputs:
        raise ValueError(
            f"{path}: no request in the recording finished with a known output length "
            "(the gateway meters and records it only with tenants.auth on); "
            "nothing to size the requests by"
        )
    fallback = _lower_median(answered or Counter(outputs.values()))
    if missing > 0:
        reader.notes.append(
            f"{path}: {missing:,} of {arrivals:,} recorded requests have no output length "
            "(rejected, client gone, stream broken, or in flight when the recording ended): "
            f"they replay with the median answer, {fallback:,} tokens"
        )
    return outputs, fallback


def _lower_median(lengths: Counter[int]) -> int:
    """The value at rank ⌊(n − 1) / 2⌋ of the sorted lengths (the reports' quantiles)."""
    rank = (lengths.total() - 1) // 2
    for length, count in sorted(lengths.items()):
        rank -= count
        if rank < 0:
            return length
    raise ValueError("no lengths")  # unreachable: callers pass a non-empty counter


def _events(
    path: Path, *, only: str | None = None, reader: TraceReader | None = None
) -> Iterator[tuple[int, float, dict[str, Any]]]:
    """(line, t, event) of every event line after the header; ``only``: skip lines that do
    not contain it (the first pass has checked them); ``reader``: note what the header says."""
    with path.open(encoding="utf-8-sig", newline="") as file:
        head = _header(path, file.readline())
        if reader is not None:
            reader.notes.extend(_unhashed_pools(path, head))
        for line, text in enumerate(file, start=2):
            if not text.strip() or (only is not None and only not in text):
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line}: JSON: {error.msg} (column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line}: JSON: expected an object")
            t = record.get("t")
            if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
                raise ValueError(f"{path}:{line}: t: {t!r} is not a time in seconds")
            event = record.get("event")
            if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
                raise ValueError(f"{path}:{line}: event: expected an object with a kind")
            yield line, float(t), event


def _header(path: Path, first: str) -> dict[str, Any]:
    try:
        head, _ = read_recording([first])
    except ValueError as error:
        raise ValueError(f"{path}:1: {error}") from None
    return head


def _unhashed_pools(path: Path, head: dict[str, Any]) -> list[str]:
    """Notes for the pools whose recorded router did not hash prompts (none were recorded)."""
    try:
        fleet = FleetConfig.model_validate(head.get("fleet"))
    except ValueError:  # a pydantic ValidationError is one
        return [
            f"{path}: the recording's fleet file does not load here, so which pools hashed "
            "their prompts is unknown; a request recorded without hashes shares no prefix"
        ]
    return [
        f"{path}: pool {m.name!r} was recorded with {m.routing.policy} routing, which does "
        "not hash prompts: its requests replay with no shared prefixes"
        for m in fleet.models
        if not PoolSettings.of(fleet, m).hashes
    ]


def _text(path: Path, line: int, event: dict[str, Any], key: str) -> str | None:
    """An optional string field (session, tenant)."""
    value = event.get(key)
    return None if value is None else _name(path, line, event, key)


def _name(path: Path, line: int, event: dict[str, Any], key: str) -> str:
    """A required string field (id, model)."""
    value = event.get(key)
    if isinstance(value, str):
        return value
    problem = "missing" if value is None else f"{value!r} is not a string"
    raise ValueError(f"{path}:{line}: {event['kind']}.{key}: {problem}")


def _count(path: Path, line: int, event: dict[str, Any], key: str) -> int:
    value = event.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"{path}:{line}: {event['kind']}.{key}: {value!r} is not a count >= 0")
    return value


def _hashes(path: Path, line: int, event: dict[str, Any]) -> list[int]:
    value = event.get("hashes")
    if not isinstance(value, list) or any(type(h) is not int for h in value):
        raise ValueError(f"{path}:{line}: arrived.hashes: expected a list of integers")
    return value
