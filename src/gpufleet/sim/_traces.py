"""Request traces: public formats read into one small record, one row at a time.

    reader = load_trace("AzureLLMInferenceTrace_conv.csv", rate_scale=2.0, duration=600)
    for request in reader:          # TraceRequest(arrival_s, input_tokens, output_tokens, ...)
        ...
    reader.skipped                  # rows left out (BurstGPT's failed requests)

Readers stream: a row is parsed when it is asked for, so a trace of millions of requests
never sits in memory. Every format ends in the same pipeline::

    file rows ──parse──► (line, arrival, lengths, ...) ──check order──► ÷ rate_scale
              ──cut at duration──► TraceRequest

Timestamps must not go back (the simulator feeds arrivals one at a time). A bad row is a
``ValueError`` naming the file, the line and the field. docs/traces.md documents the
formats, the gpufleet JSONL schema and the choices made for each public trace. A pool
controller's recording is a trace too (``sim/_recording_trace.py``: a what-if on recorded
traffic).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, Final

from gpufleet.sim._arrivals import ArrivalProcess
from gpufleet.sim._recording_trace import recording_rows

PREFIX_BLOCK_TOKENS = 512
"""Tokens per prefix block named by a trace's ``hash_ids`` (Mooncake's block size)."""
PREFIX_HASH_TOKENS = 128
"""Tokens per block of the gateway's prefix hashes: a 512-character block at the gateway's
estimate of 4 characters a token. The simulated router hashes blocks of this many ids, and a
recording's ``hash_ids`` name blocks of this size."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is, nothing more."""

    arrival_s: float
    """Seconds from the start of the trace (after ``rate_scale``)."""
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    """Names of the prompt's leading blocks of ``block_tokens`` tokens: equal ids are equal
    blocks (Mooncake)."""
    session: str | None = None
    model: str | None = None
    tenant: str | None = None
    """Who sent it (gpufleet JSONL ``tenant``): the simulated gateway's admission queue
    shares the fleet fairly between tenants (docs/simulator.md, "Tenants and admission")."""
    block_tokens: int = PREFIX_BLOCK_TOKENS
    """Tokens per ``hash_ids`` block: 512 (Mooncake's), or :data:`PREFIX_HASH_TOKENS` for a
    recording, whose blocks are the gateway's 512-character ones."""


class TraceFormat(StrEnum):
    """The trace formats ``load_trace`` reads (the names of ``--format``)."""

    AZURE = "azure"
    """Azure LLM inference 2023/2024 CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    MOONCAKE = "mooncake"
    """Mooncake JSON lines: timestamp (ms), input_length, output_length, hash_ids."""
    BURSTGPT = "burstgpt"
    """BurstGPT CSV: Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type."""
    JSONL = "jsonl"
    """gpufleet JSON lines: arrival_s, input_tokens, output_tokens (+ hash_ids, session, model)."""
    LENGTHS = "lengths"
    """Length-only CSV (Vidur's num_prefill_tokens, num_decode_tokens); needs arrivals."""
    RECORDING = "recording"
    """A pool controller recording (``gpufleet up --record``): its arrivals, sized by their
    ``finished`` events (docs/traces.md, "What-if on a recording")."""


class TraceReader(Iterator[TraceRequest]):
    """The requests of one trace file, read lazily, once; made by :func:`load_trace`."""

    __slots__ = ("_rows", "estimated", "format", "notes", "path", "requests", "skipped")

    def __init__(self, path: Path, fmt: TraceFormat) -> None:
        self.path = path
        self.format = fmt
        self.requests = 0
        """Requests handed out so far."""
        self.skipped = 0
        """Rows left out so far: BurstGPT's failed requests (0 response tokens)."""
        self.estimated = 0
        """Requests handed out so far whose output length the trace does not say: a
        recording's requests that never finished with one (they get its median)."""
        self.notes: list[str] = []
        """What a user should know about how the file was read (``gpufleet simulate``
        prints them once the trace is read)."""
        self._rows: Iterator[TraceRequest] = iter(())

    def __next__(self) -> TraceRequest:
        request = next(self._rows)
        self.requests += 1
        return request


def load_trace(
    path: str | Path,
    format: TraceFormat | str | None = None,  # the CLI's --format
    *,
    rate_scale: float = 1.0,
    duration: float | None = None,
    arrivals: ArrivalProcess | None = None,
    rng: random.Random | None = None,
) -> TraceReader:
    """Open a trace: its format is detected from the extension and header unless given.

    ``rate_scale`` 2 replays the trace twice as fast (arrival times halved); ``duration``
    keeps the requests that arrive before it (in scaled seconds). ``arrivals`` replaces the
    file's timestamps with a Poisson or gamma process drawn from ``rng``; a ``lengths``
    table has no timestamps and needs both.
    """
    trace = Path(path)
    if not trace.is_file():
        raise FileNotFoundError(f"{trace}: no such trace file")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    if duration is not None and not duration >= 0:
        raise ValueError(f"duration must be >= 0 seconds, got {duration}")
    fmt = detect_format(trace) if format is None else _format(format)
    if fmt is TraceFormat.LENGTHS and arrivals is None:
        raise ValueError(
            f"{trace}: a lengths table has no timestamps: pass arrivals=ArrivalProcess(rate=...)"
        )
    if arrivals is not None and rng is None:
        raise ValueError("synthetic arrivals need a seeded rng (random.Random(seed))")
    reader = TraceReader(trace, fmt)
    times = None
    if arrivals is not None and rng is not None:
        times = arrivals.scaled(rate_scale).times(rng)
    reader._rows = _requests(reader, rate_scale, duration, times)
    return reader


def detect_format(path: str | Path) -> TraceFormat:
    """The format of a trace file, from its extension and its first line."""
    trace = Path(path)
    with _open(trace) as file:
        try:
            first = next((line for line in file if line.strip()), "")
        except UnicodeDecodeError as error:
            raise _not_text(trace, error) from None
        except (gzip.BadGzipFile, EOFError) as error:
            raise _not_gzip(trace, error) from None
    # the name says the format under a .gz: trace.csv.gz is a CSV
    named = Path(trace.stem) if trace.suffix.lower() == ".gz" else trace
    suffix = named.suffix.lower()
    looks_json = first.lstrip().startswith("{")
    if suffix in {".jsonl", ".json", ".ndjson"} or (suffix != ".csv" and looks_json):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            keys = set()
        for fmt, required in _JSON_KEYS:
            if required <= keys:
                return fmt
        found = ", ".join(sorted(keys)) or "no JSON object"
    else:
        columns = {name.strip() for name in next(csv.reader([first]), [])}
        for fmt, required in _CSV_COLUMNS:
            if required <= columns:
                return fmt
        found = ", ".join(sorted(columns)) or "an empty first line"
    formats = ", ".join(f.value for f in TraceFormat)
    raise ValueError(
        f"{trace}:1: cannot tell the trace format from {found}; "
        f"pass format= (one of {formats}); docs/traces.md lists what each needs"
    )


# -- the common pipeline ----------------------------------------------------------------

_Row = tuple[int, float, int, int, tuple[int, ...] | None, str | None, str | None, str | None]
"""(line, arrival seconds, input tokens, output tokens, hash ids, session, model, tenant)."""


def _requests(
    reader: TraceReader, rate_scale: float, duration: float | None, times: Iterator[float] | None
) -> Iterator[TraceRequest]:
    """Check the order, scale, cut: the part every format shares."""
    path = reader.path
    rows = _PARSERS[reader.format](path, reader)
    end = math.inf if duration is None else duration
    block = _BLOCK_TOKENS.get(reader.format, PREFIX_BLOCK_TOKENS)
    last = -math.inf
    try:
        for line, arrival, input_tokens, output_tokens, hashes, session, model, tenant in rows:
            if times is not None:
                at = next(times)
            else:
                if arrival < last:
                    raise ValueError(
                        f"{path}:{line}: timestamp: {arrival:.6f} s comes before the previous "
                        f"row's {last:.6f} s; sort the trace by arrival time"
                    )
                last = arrival
                at = arrival / rate_scale
            if at >= end:
                return
            yield TraceRequest(
                at, input_tokens, output_tokens, hashes, session, model, tenant, block
            )
    except UnicodeDecodeError as error:
        raise _not_text(path, error) from None
    except (gzip.BadGzipFile, EOFError) as error:
        raise _not_gzip(path, error) from None


def _not_text(path: Path, error: UnicodeDecodeError) -> ValueError:
    return ValueError(f"{path}: not UTF-8 text ({error.reason} in a block read from it)")


def _not_gzip(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path}: not a whole gzip file ({error})")


SAMPLE_TRACE: Final = Path(__file__).parent / "data" / "azure-conv-2023.csv.gz"
"""The trace shipped in the package (data/README.md): the Azure 2023 conversation hour,
19,366 requests. ``gpufleet simulate``'s trace and ``gpufleet trace synth``'s size table
when none is given."""


def _format(value: TraceFormat | str) -> TraceFormat:
    try:
        return TraceFormat(value)
    except ValueError:
        formats = ", ".join(f.value for f in TraceFormat)
        raise ValueError(f"unknown trace format {value!r}; expected one of {formats}") from None


def _open(path: Path) -> IO[str]:
    # utf-8-sig drops a byte-order mark; newline="" lets csv handle \r\n itself.
    if path.suffix.lower() == ".gz":  # any format, gzipped (the packaged sample is)
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


# -- CSV formats --------------------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")
_VIDUR_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
_PLAIN_LENGTH_COLUMNS = ("input_tokens", "output_tokens")

_CSV_COLUMNS = [
    (TraceFormat.AZURE, frozenset(_AZURE_COLUMNS)),
    (TraceFormat.BURSTGPT, frozenset(_BURSTGPT_COLUMNS)),
    (TraceFormat.LENGTHS, frozenset(_VIDUR_COLUMNS)),
    (TraceFormat.LENGTHS, frozenset(_PLAIN_LENGTH_COLUMNS)),
]
_JSON_KEYS = [
    (TraceFormat.RECORDING, frozenset({"gpufleet_recording"})),
    (TraceFormat.MOONCAKE, frozenset({"timestamp", "input_length", "output_length"})),
    (TraceFormat.JSONL, frozenset({"arrival_s", "input_tokens", "output_tokens"})),
]


class _Csv:
    """A CSV file read row by row with its header: cells by column name, errors by line."""

    def __init__(self, file: IO[str], path: Path) -> None:
        self.path = path
        self._reader = csv.reader(file)
        self.header = [name.strip() for name in next(self._reader, [])]
        self.width = len(self.header)
        self.index: dict[str, int] = {}

    def require(self, names: tuple[str, ...]) -> None:
        missing = [name for name in names if name not in self.header]
        if missing:
            raise ValueError(f"{self.path}:1: header: missing column(s) {', '.join(missing)}")
        self.index = {name: self.header.index(name) for name in names}

    def rows(self) -> Iterator[tuple[int, list[str]]]:
        reader = self._reader
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank line
            if len(row) < self.width:
                raise ValueError(
                    f"{self.path}:{reader.line_num}: row: {len(row)} fields, "
                    f"the header has {self.width}"
                )
            yield reader.line_num, row

    def cell(self, row: list[str], name: str) -> str:
        return row[self.index[name]].strip()

    def int(self, line: int, row: list[str], name: str, minimum: int) -> int:
        text = self.cell(row, name)
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{self.path}:{line}: {name}: {text!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{self.path}:{line}: {name}: {value} is below {minimum}")
        return value


def _azure_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """Azure LLM inference traces (2023 and 2024): seconds from the first row."""
    with _open(path) as file:
        table = _Csv(file, path)
        table.require(_AZURE_COLUMNS)
        origin: int | None = None
        days: dict[str, int] = {}
        for line, row in table.rows():
            text = table.cell(row, "TIMESTAMP")
            ns = _timestamp_ns(text, days)
            if ns is None:
                raise ValueError(
                    f"{path}:{line}: TIMESTAMP: {text!r} is not a time like "
                    "'2023-11-16 18:15:46.6805900'"
                )
            if origin is None:
                origin = ns
            yield (
                line,
                (ns - origin) / 1e9,
                table.int(line, row, "ContextTokens", 1),
                table.int(line, row, "GeneratedTokens", 1),
                None,
                None,
                None,
                None,
            )


def _burstgpt_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """BurstGPT: seconds from the first row; failed requests (0 tokens) are skipped."""
    with _open(path) as file:
        table = _Csv(file, path)
        table.require(_BURSTGPT_COLUMNS)
        origin: float | None = None
        for line, row in table.rows():
            arrival = _csv_seconds(table, line, row, "Timestamp")
            request_tokens = table.int(line, row, "Request tokens", 0)
            response_tokens = table.int(line, row, "Response tokens", 0)
            if origin is None:
                origin = arrival
            if request_tokens == 0 or response_tokens == 0:
                reader.skipped += 1  # BurstGPT marks a failed request by 0 response tokens
                continue
            model = table.cell(row, "Model") or None
            yield line, arrival - origin, request_tokens, response_tokens, None, None, model, None


def _lengths_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """Length pairs only (arrival times come from an ArrivalProcess)."""
    with _open(path) as file:
        table = _Csv(file, path)
        vidur = set(_VIDUR_COLUMNS) <= set(table.header)
        names = _VIDUR_COLUMNS if vidur else _PLAIN_LENGTH_COLUMNS
        table.require(names)
        prompt, output = names
        for line, row in table.rows():
            yield (
                line,
                0.0,
                table.int(line, row, prompt, 1),
                table.int(line, row, output, 1),
                None,
                None,
                None,
                None,
            )


def _csv_seconds(table: _Csv, line: int, row: list[str], name: str) -> float:
    text = table.cell(row, name)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{table.path}:{line}: {name}: {text!r} is not a number of seconds >= 0")
    return value


_TIMESTAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:(Z)|([+-])(\d{2}):?(\d{2}))?"
)


def _timestamp_ns(text: str, days: dict[str, int]) -> int | None:
    """An ISO-8601 wall-clock time as integer nanoseconds (exact for 7 fractional digits)."""
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        return None
    day, hours, minutes, seconds, fraction, _, sign, tz_hours, tz_minutes = match.groups()
    ordinal = days.get(day)
    if ordinal is None:
        try:
            ordinal = date.fromisoformat(day).toordinal()
        except ValueError:
            return None
        days[day] = ordinal
    h, m, s = int(hours), int(minutes), int(seconds)
    if h > 23 or m > 59 or s > 60:
        return None
    total = ((ordinal * 24 + h) * 60 + m) * 60 + s
    if sign is not None:
        offset = int(tz_hours) * 3600 + int(tz_minutes) * 60
        total -= offset if sign == "+" else -offset
    nanos = int(fraction.ljust(9, "0")) if fraction else 0
    return total * 1_000_000_000 + nanos


# -- JSON-lines formats ---------------------------------------------------------------------


def _json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open(path) as file:
        for line, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line}: JSON: {error.msg} (column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line}: JSON: expected an object, got {text.strip()!r}")
            yield line, record


def _field(path: Path, line: int, record: dict[str, Any], key: str) -> Any:
    try:
        return record[key]
    except KeyError:
        raise ValueError(f"{path}:{line}: {key}: missing") from None


def _json_int(path: Path, line: int, record: dict[str, Any], key: str, minimum: int) -> int:
    value = _field(path, line, record, key)
    if type(value) is not int:
        raise ValueError(f"{path}:{line}: {key}: {value!r} is not an integer")
    if value < minimum:
        raise ValueError(f"{path}:{line}: {key}: {value} is below {minimum}")
    return value


def _json_seconds(path: Path, line: int, record: dict[str, Any], key: str) -> float:
    value = _field(path, line, record, key)
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{path}:{line}: {key}: {value!r} is not a number >= 0")
    return float(value)


def _json_hashes(path: Path, line: int, record: dict[str, Any], key: str) -> tuple[int, ...] | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or any(type(h) is not int or h < 0 for h in value):
        raise ValueError(f"{path}:{line}: {key}: expected a list of integers >= 0")
    return tuple(value)


def _json_text(path: Path, line: int, record: dict[str, Any], key: str) -> str | None:
    value = record.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{path}:{line}: {key}: {value!r} is not a string")


def _mooncake_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """Mooncake: ``timestamp`` in milliseconds from the trace start, taken as is."""
    for line, record in _json_objects(path):
        yield (
            line,
            _json_seconds(path, line, record, "timestamp") / 1000.0,
            _json_int(path, line, record, "input_length", 1),
            _json_int(path, line, record, "output_length", 1),
            _json_hashes(path, line, record, "hash_ids"),
            None,
            None,
            None,
        )


JSONL_KEYS = frozenset(
    {"arrival_s", "input_tokens", "output_tokens", "hash_ids", "session", "model", "tenant"}
)
"""Every key a gpufleet JSONL record may have (docs/traces.md)."""


def _jsonl_rows(path: Path, reader: TraceReader) -> Iterator[_Row]:
    """gpufleet JSONL: the documented schema, strictly (unknown keys are errors)."""
    for line, record in _json_objects(path):
        unknown = record.keys() - JSONL_KEYS
        if unknown:
            raise ValueError(
                f"{path}:{line}: {sorted(unknown)[0]}: unknown key; "
                f"a gpufleet JSONL record has {', '.join(sorted(JSONL_KEYS))}"
            )
        yield (
            line,
            _json_seconds(path, line, record, "arrival_s"),
            _json_int(path, line, record, "input_tokens", 1),
            _json_int(path, line, record, "output_tokens", 1),
            _json_hashes(path, line, record, "hash_ids"),
            _json_text(path, line, record, "session"),
            _json_text(path, line, record, "model"),
            _json_text(path, line, record, "tenant"),
        )


_PARSERS: dict[TraceFormat, Callable[[Path, TraceReader], Iterator[_Row]]] = {
    TraceFormat.AZURE: _azure_rows,
    TraceFormat.MOONCAKE: _mooncake_rows,
    TraceFormat.BURSTGPT: _burstgpt_rows,
    TraceFormat.JSONL: _jsonl_rows,
    TraceFormat.LENGTHS: _lengths_rows,
    TraceFormat.RECORDING: recording_rows,
}
_BLOCK_TOKENS: dict[TraceFormat, int] = {TraceFormat.RECORDING: PREFIX_HASH_TOKENS}
"""Formats whose ``hash_ids`` name blocks other than Mooncake's 512 tokens."""
