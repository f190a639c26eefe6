"""A running batch's lines: claimed by workers, their results recorded exactly once.

::

    lines = store.batch_lines
    for claim in lines.claim(batch_id, worker="gw-1", now=now, limit=32, lease_s=300):
        ...run claim.body against the batch's endpoint...
        lines.record(batch_id, claim.line, LineResult.response(200, body), now=now)
    lines.release(batch_id, [claim.line], worker="gw-1")   # give back (a drained replica)

A line is ``pending``, ``claimed`` (by a worker, until its lease runs out) or ``done``::

    pending ──claim──► claimed ──record──► done        (done is final: a second record of
       ▲                  │                             the same line changes nothing)
       └──release/lease───┘

Each move is one conditional ``UPDATE`` whose ``WHERE`` holds the rule (``state != 'done'``,
the batch still running), so it is atomic in SQLite (one writer at a time) and in PostgreSQL
(a row's second writer waits, then re-checks the ``WHERE``; claims skip rows another claim
holds: ``FOR UPDATE SKIP LOCKED``). A worker killed mid-line leaves it ``claimed``: the line is
claimable again once the lease runs out, and whatever the first run recorded stays.

Execution is at least once (a worker may die after running a line and before recording it);
recording is exactly once, so the output file has each line once. A line's ``request_id``
(``batch_req_…``) is fixed when the batch starts: the gateway uses it as the line's ledger id,
so a second run of a line is not billed twice (the ledger skips a known id).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, Engine, Integer, and_, exists, func, or_, select, update

from gpufleet.fleet import BATCH_RUNNING, BatchProgress, BatchStatus, RequestCounts
from gpufleet.store import _schema as s
from gpufleet.store._errors import StoreError, clean

PENDING: Final = "pending"
CLAIMED: Final = "claimed"
DONE: Final = "done"
DEFAULT_LEASE_S: Final = 300.0

_L = s.batch_lines.c
_B = s.batches.c


@dataclass(frozen=True, slots=True)
class LineClaim:
    """A line a worker now holds: run ``body`` against the batch's endpoint."""

    line: int
    custom_id: str
    request_id: str
    body: Mapping[str, Any]
    attempt: int
    """1 on its first claim; more when a lease ran out or the line was released."""


@dataclass(frozen=True, slots=True)
class LineResult:
    """How a line ended: an HTTP response (any status), or an error before one."""

    status_code: int | None = None
    body: Mapping[str, Any] | None = None
    upstream_id: str | None = None
    """The response's ``x-request-id`` (the output's ``response.request_id``)."""
    error_code: str | None = None
    error_message: str | None = None

    def __post_init__(self) -> None:
        if (self.status_code is None) == (self.error_code is None):
            raise StoreError("a line result is a response or an error, not both")

    @classmethod
    def response(
        cls, status_code: int, body: Mapping[str, Any], upstream_id: str | None = None
    ) -> LineResult:
        return cls(status_code=status_code, body=body, upstream_id=upstream_id)

    @classmethod
    def error(cls, code: str, message: str) -> LineResult:
        return cls(error_code=code, error_message=message)

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


class BatchLines:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def claim(
        self,
        batch_id: str,
        *,
        worker: str,
        now: float,
        limit: int,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> list[LineClaim]:
        """Up to ``limit`` lines to run, in the batch's run order (``run_order``, then input
        order): pending ones, and claimed ones whose lease ran out; none unless the batch is
        ``in_progress``."""
        claimable = and_(
            _L.batch_id == batch_id,
            or_(_L.state == PENDING, and_(_L.state == CLAIMED, _L.lease_until <= now)),
        )
        # The lines are picked in a CTE, evaluated once: PostgreSQL may run an ``IN
        # (subquery)`` again for each row it updates and pick more than ``limit``.
        picked = (
            select(_L.line)
            .where(claimable)
            .order_by(_L.run_order, _L.line)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .cte("picked")
        )
        stmt = (
            update(s.batch_lines)
            .where(
                claimable, _L.line == picked.c.line, _running(batch_id, {BatchStatus.IN_PROGRESS})
            )
            .values(
                state=CLAIMED, worker=worker, lease_until=now + lease_s, attempts=_L.attempts + 1
            )
            .returning(_L.line, _L.custom_id, _L.request_id, _L.body, _L.attempts, _L.run_order)
        )
        with self.engine.begin() as conn:
            rows = sorted(
                conn.execute(stmt).all(),
                key=lambda r: (-1 if r.run_order is None else r.run_order, r.line),
            )
        return [
            LineClaim(r.line, r.custom_id, r.request_id, json.loads(r.body), r.attempts)
            for r in rows
        ]

    def renew(
        self, batch_id: str, lines: Iterable[int], *, worker: str, now: float, lease_s: float
    ) -> int:
        """Extend ``worker``'s leases on ``lines``; returns how many it still held."""
        return self._mine(batch_id, lines, worker, {"lease_until": now + lease_s})

    def release(self, batch_id: str, lines: Iterable[int], *, worker: str) -> int:
        """Give ``worker``'s claims on ``lines`` back (claimable at once); returns how many."""
        return self._mine(
            batch_id, lines, worker, {"state": PENDING, "lease_until": None, "worker": None}
        )

    def record(self, batch_id: str, line: int, result: LineResult, *, now: float) -> bool:
        """Record ``line``'s result once: ``True`` if this call recorded it, ``False`` if the
        line was already done (a repeated write) or the batch no longer takes results."""
        values: dict[str, Any] = {"state": DONE, "done_at": now, "lease_until": None}
        if result.status_code is not None:
            response = {
                "status_code": result.status_code,
                "request_id": result.upstream_id,
                "body": result.body,
            }
            values |= {"status_code": result.status_code, "response": json.dumps(response)}
        else:
            values |= {
                "error_code": clean(result.error_code or "")[:64],
                "error_message": clean(result.error_message or ""),
            }
        stmt = (
            update(s.batch_lines)
            .where(
                _L.batch_id == batch_id,
                _L.line == line,
                _L.state != DONE,
                _running(batch_id, BATCH_RUNNING),
            )
            .values(**values)
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def pending(self, batch_id: str) -> list[int]:
        """Lines not done yet (claimed or not), in input order."""
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    select(_L.line)
                    .where(_L.batch_id == batch_id, _L.state != DONE)
                    .order_by(_L.line)
                ).scalars()
            )

    def progress(self, batch_id: str, now: float) -> BatchProgress | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(_B.status, _B.expires_at, _B.cancelling_at).where(_B.id == batch_id)
            ).first()
            if row is None:
                return None
            in_flight = conn.execute(
                select(func.count()).where(
                    _L.batch_id == batch_id, _L.state == CLAIMED, _L.lease_until > now
                )
            ).scalar_one()
            counts = request_counts(conn, [batch_id]).get(batch_id, RequestCounts())
        return BatchProgress(
            BatchStatus(row.status), row.expires_at, counts, in_flight, row.cancelling_at
        )

    def _mine(
        self, batch_id: str, lines: Iterable[int], worker: str, values: dict[str, Any]
    ) -> int:
        stmt = (
            update(s.batch_lines)
            .where(
                _L.batch_id == batch_id,
                _L.line.in_(list(lines)),
                _L.worker == worker,
                _L.state == CLAIMED,
            )
            .values(**values)
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount


def request_counts(conn: Connection, batch_ids: Sequence[str]) -> dict[str, RequestCounts]:
    """Each batch's lines, and those done with a 2xx response or otherwise."""
    ok = and_(_L.state == DONE, _L.status_code >= 200, _L.status_code < 300)
    rows = conn.execute(
        select(
            _L.batch_id,
            func.count(),
            func.coalesce(func.sum(ok.cast(Integer)), 0),
            func.coalesce(func.sum((_L.state == DONE).cast(Integer)), 0),
        )
        .where(_L.batch_id.in_(list(batch_ids)))
        .group_by(_L.batch_id)
    ).all()
    return {r[0]: RequestCounts(int(r[1]), int(r[2]), int(r[3]) - int(r[2])) for r in rows}


def finish_unfinished(
    conn: Connection, batch_id: str, code: str, message: str, *, now: float
) -> None:
    """End every line not done with an error (the batch expired or was cancelled)."""
    conn.execute(
        update(s.batch_lines)
        .where(_L.batch_id == batch_id, _L.state != DONE)
        .values(state=DONE, done_at=now, lease_until=None, error_code=code, error_message=message)
    )


def output_lines(
    conn: Connection, batch_id: str, *, page: int = 1000
) -> Iterator[tuple[bool, bytes]]:
    """Every done line as a line of the output (``True``) or the error file, in input order,
    read a page at a time."""
    last = 0
    while True:
        rows = conn.execute(
            select(
                _L.line,
                _L.custom_id,
                _L.request_id,
                _L.status_code,
                _L.response,
                _L.error_code,
                _L.error_message,
            )
            .where(_L.batch_id == batch_id, _L.line > last, _L.state == DONE)
            .order_by(_L.line)
            .limit(page)
        ).all()
        if not rows:
            return
        for r in rows:
            error = (
                None if r.error_code is None else {"code": r.error_code, "message": r.error_message}
            )
            response = None if r.response is None else json.loads(r.response)
            out = {
                "id": r.request_id,
                "custom_id": r.custom_id,
                "response": response,
                "error": error,
            }
            ok = r.status_code is not None and 200 <= r.status_code < 300
            yield ok, json.dumps(out).encode() + b"\n"
        last = rows[-1].line


def _running(batch_id: str, statuses: Iterable[BatchStatus]) -> Any:
    return exists().where(_B.id == batch_id, _B.status.in_([str(x) for x in statuses]))
