"""What a simulation measured: one compact row per request, one histogram of token gaps.

A finished request is a row of nine numbers in typed arrays (about 60 bytes), not an
object, so a million requests fit in ~60 MB::

    column         index  replica  arrival  first_token  finish  input  output  cached  rejected
    type           int64  int32    float64  float64      float64 int64  int64   int64   int8

(``rejected`` is 0 for a response, 1 for a request the replica refused, 2 for an error.)

Rows are appended in the order requests end, which a seeded run reproduces exactly, so
``Recorder.digest()`` (SHA-256 over every column and the histogram) is the determinism
check: same inputs and seed, same digest.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from gpufleet.sim._stats import LogHistogram


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the simulation saw it (times in virtual seconds)."""

    index: int
    """Position in the trace."""
    replica: int
    arrival_s: float
    first_token_s: float | None
    """None when the replica refused the request."""
    finish_s: float
    """When its last token came out (or when it was refused)."""
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    rejected: bool
    failed: bool = False
    """Ended in an error: no replica could take it, its retries ran out, or its replica
    crashed after the first token (stored as 2 in the ``rejected`` column)."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


class RequestLog:
    """Columns of finished requests, in the order they ended."""

    __slots__ = (
        "_arrival",
        "_cached",
        "_finish",
        "_first",
        "_index",
        "_input",
        "_output",
        "_rejected",
        "_replica",
    )

    def __init__(self) -> None:
        self._index = array("q")
        self._replica = array("i")
        self._arrival = array("d")
        self._first = array("d")
        self._finish = array("d")
        self._input = array("q")
        self._output = array("q")
        self._cached = array("q")
        self._rejected = array("b")

    def append(self, record: RequestRecord) -> None:
        self._index.append(record.index)
        self._replica.append(record.replica)
        self._arrival.append(record.arrival_s)
        self._first.append(math.nan if record.first_token_s is None else record.first_token_s)
        self._finish.append(record.finish_s)
        self._input.append(record.input_tokens)
        self._output.append(record.output_tokens)
        self._cached.append(record.cached_tokens)
        self._rejected.append(2 if record.failed else int(record.rejected))

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> RequestRecord:
        first = self._first[i]
        return RequestRecord(
            index=self._index[i],
            replica=self._replica[i],
            arrival_s=self._arrival[i],
            first_token_s=None if math.isnan(first) else first,
            finish_s=self._finish[i],
            input_tokens=self._input[i],
            output_tokens=self._output[i],
            cached_tokens=self._cached[i],
            rejected=self._rejected[i] == 1,
            failed=self._rejected[i] == 2,
        )

    def __iter__(self) -> Iterator[RequestRecord]:
        for i in range(len(self)):
            yield self[i]

    def columns(self) -> Iterator[array[int] | array[float]]:
        yield from (self._index, self._replica, self._arrival, self._first, self._finish)
        yield from (self._input, self._output, self._cached, self._rejected)


class Recorder:
    """Collects what every replica driver of one simulation measured.

    Inter-token latency (the gap before every generated token but the first) is kept per
    replica: a replica adds its gaps in its own time order, so the histograms do not depend
    on how the steps of different replicas interleave.
    """

    __slots__ = ("_accuracy", "_itl", "log")

    def __init__(self, relative_accuracy: float = 0.005) -> None:
        self.log = RequestLog()
        self._accuracy = relative_accuracy
        self._itl: dict[int, LogHistogram] = {}

    def replica_itl(self, replica: int) -> LogHistogram:
        """Replica ``replica``'s inter-token latencies (created empty on first use)."""
        itl = self._itl.get(replica)
        if itl is None:
            itl = self._itl[replica] = LogHistogram(self._accuracy)
        return itl

    @property
    def itl(self) -> LogHistogram:
        """Inter-token latencies of the whole fleet (merged in replica order)."""
        merged = LogHistogram(self._accuracy)
        for replica in sorted(self._itl):
            merged.merge(self._itl[replica])
        return merged

    def digest(self) -> str:
        """SHA-256 of everything recorded: equal digests, equal results."""
        sha = hashlib.sha256()
        for column in self.log.columns():
            data = array(column.typecode, column)
            if sys.byteorder == "big":  # pragma: no cover - no big-endian CI machine
                data.byteswap()
            sha.update(column.typecode.encode())
            sha.update(data.tobytes())
        for replica in sorted(self._itl):
            itl = self._itl[replica]
            sha.update(struct.pack("<qqddd", replica, itl.count, itl.total, itl.min, itl.max))
            for key, count in itl.buckets():
                sha.update(struct.pack("<qq", key, count))
        return sha.hexdigest()
