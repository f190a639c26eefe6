"""``/v1/batches`` in the store: create, retrieve, list, cancel, and ``advance``, the one
call a runner makes to move a batch along its lifecycle (``gpufleet.fleet.BatchStatus``).

::

    batches = store.batches
    b = batches.create("team-a", f.id, "/v1/chat/completions", metadata={...}, now=now)
    batches.advance(b.id, now=now)      # validating → in_progress (lines written) or failed
    ...workers claim and record lines (store.batch_lines)...
    batches.advance(b.id, now=now)      # → finalizing → completed, output files written
    batches.cancel(b.id, owner="team-a", now=now)             # → cancelling
    batches.unfinished()                # what a restarted gateway resumes

Every move is a compare-and-set on the status (``WHERE status IN batch_sources(target)``) in
the transaction that does the move's work (writing the lines, or the output and error files),
so two gateways that advance one batch at once move it once, and a crash leaves the batch
before the move or after it, never half way.
"""

from __future__ import annotations

import builtins
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import Connection, Engine, Row, and_, func, insert, not_, select, update

from gpufleet.fleet import (
    BATCH_CANCEL_GRACE_S,
    BATCH_CANCELLABLE,
    BATCH_ENDPOINTS,
    BATCH_TERMINAL,
    BATCH_TIMESTAMPS,
    BATCH_WINDOWS,
    BatchInput,
    BatchStatus,
    LineError,
    RequestCounts,
    batch_sources,
    next_batch_status,
    parse_batch_input,
    prefix_ranks,
)
from gpufleet.store import _schema as s
from gpufleet.store._batch_lines import (
    CLAIMED,
    DONE,
    PENDING,
    BatchLines,
    finish_unfinished,
    output_lines,
    request_counts,
)
from gpufleet.store._errors import StoreError
from gpufleet.store._files import Files, FileWriter, after_cursor, page_json

MAX_BATCHES_PAGE: Final = 100
MAX_METADATA_KEYS: Final = 16
_B = s.batches.c
_S = BatchStatus
_ENDED: Final = {
    _S.EXPIRED: (
        "batch_expired",
        "This request could not be run before the completion window expired.",
    ),
    _S.CANCELLED: ("batch_cancelled", "This request was not run: the batch was cancelled."),
}
"""The error a line not done gets when its batch ends without it."""


@dataclass(frozen=True, slots=True)
class Batch:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: float
    expires_at: float
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[LineError, ...] = ()
    metadata: Mapping[str, str] | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)

    def to_openai(self) -> dict[str, Any]:
        """The batch object as OpenAI's API returns it (times in whole Unix seconds)."""
        times = ("created_at", "in_progress_at", "expires_at", *BATCH_TIMESTAMPS.values())
        errors = [e.to_openai() for e in self.errors]
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": str(self.status),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            **{t: _unix(getattr(self, t)) for t in times},
            "request_counts": self.request_counts.to_openai(),
            "metadata": None if self.metadata is None else dict(self.metadata),
        }


@dataclass(frozen=True, slots=True)
class BatchPage:
    data: tuple[Batch, ...]
    has_more: bool

    def to_openai(self) -> dict[str, Any]:
        return page_json(self.data, self.has_more)


class Batches:
    """The batches of one database, each visible only to its owner (a tenant)."""

    def __init__(self, engine: Engine, files: Files, lines: BatchLines) -> None:
        self.engine = engine
        self.files = files
        self.lines = lines

    def create(
        self,
        owner: str,
        input_file_id: str,
        endpoint: str,
        *,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        now: float,
    ) -> Batch:
        """A batch in ``validating``; :meth:`advance` validates its input file."""
        if endpoint not in BATCH_ENDPOINTS:
            raise StoreError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}")
        window = BATCH_WINDOWS.get(completion_window)
        if window is None:
            raise StoreError(f"completion_window must be one of {', '.join(BATCH_WINDOWS)}")
        _check_metadata(metadata)
        source = self.files.get(input_file_id, owner=owner)
        if source is None or source.purpose != "batch":
            raise StoreError(f"no file {input_file_id!r} with purpose 'batch'")
        batch = Batch(
            "batch_" + secrets.token_hex(12),
            owner,
            endpoint,
            input_file_id,
            completion_window,
            _S.VALIDATING,
            now,
            now + window,
            metadata=None if metadata is None else dict(metadata),
        )
        with self.engine.begin() as conn:
            conn.execute(insert(s.batches).values(**_row(batch)))
        return batch

    def get(self, batch_id: str, *, owner: str | None) -> Batch | None:
        """The batch, if it is ``owner``'s (``owner=None``: anyone's, for the runner)."""
        query = select(s.batches).where(_B.id == batch_id)
        if owner is not None:
            query = query.where(_B.owner == owner)
        with self.engine.connect() as conn:
            return next(iter(self._batches(conn, query)), None)

    def list(self, owner: str, *, after: str | None = None, limit: int = 20) -> BatchPage:
        """``owner``'s batches, newest first, ``limit`` of them after the batch ``after``."""
        if not 1 <= limit <= MAX_BATCHES_PAGE:
            raise StoreError(f"limit must be 1 to {MAX_BATCHES_PAGE}")
        query = select(s.batches).where(_B.owner == owner)
        with self.engine.connect() as conn:
            if after is not None:
                cursor = conn.execute(
                    select(_B.created_at, _B.id).where(_B.id == after, _B.owner == owner)
                ).first()
                if cursor is None:
                    raise StoreError(f"no batch {after!r}")
                query = query.where(after_cursor(_B.created_at, _B.id, cursor, "desc"))
            query = query.order_by(_B.created_at.desc(), _B.id.desc()).limit(limit + 1)
            found = self._batches(conn, query)
        return BatchPage(tuple(found[:limit]), len(found) > limit)

    def unfinished(self) -> builtins.list[Batch]:
        """Every batch not in a terminal status, oldest first: a runner's work list."""
        query = select(s.batches).where(_B.status.not_in([str(x) for x in BATCH_TERMINAL]))
        with self.engine.connect() as conn:
            return self._batches(conn, query.order_by(_B.created_at, _B.id))

    def cancel(self, batch_id: str, *, owner: str, now: float) -> Batch | None:
        """Move the batch to ``cancelling`` (a cancelling or cancelled one is left as it is);
        ``None`` if there is no such batch; :class:`StoreError` if it already ended."""
        with self.engine.begin() as conn:
            conn.execute(
                update(s.batches)
                .where(
                    _B.id == batch_id,
                    _B.owner == owner,
                    _B.status.in_([str(x) for x in BATCH_CANCELLABLE]),
                )
                .values(status=str(_S.CANCELLING), cancelling_at=now)
            )
        batch = self.get(batch_id, owner=owner)
        if batch is not None and batch.status not in {_S.CANCELLING, _S.CANCELLED}:
            raise StoreError(f"batch {batch_id!r} is {batch.status}: it cannot be cancelled")
        return batch

    def advance(
        self,
        batch_id: str,
        *,
        now: float,
        cancel_grace_s: float = BATCH_CANCEL_GRACE_S,
        order: str = "prefix",
    ) -> Batch | None:
        """Make every move the lifecycle allows at ``now`` (``next_batch_status``), and
        validate a ``validating`` batch; returns the batch as it then is. ``order``: how a
        batch that starts now runs its lines: ``prefix`` (lines that share a prompt prefix
        together, ``fleet.prefix_ranks``) or ``input`` (the file's order)."""
        for _ in range(len(BatchStatus)):
            progress = self.lines.progress(batch_id, now)
            if progress is None:
                return None
            if progress.status is _S.VALIDATING and now < progress.expires_at:
                self._validate(batch_id, now, order)
                continue
            target = next_batch_status(now, progress, cancel_grace_s=cancel_grace_s)
            if target is None:
                break
            self._move(batch_id, target, now)
        return self.get(batch_id, owner=None)

    def _validate(self, batch_id: str, now: float, order: str) -> None:
        batch = self.get(batch_id, owner=None)
        if batch is None or batch.status is not _S.VALIDATING:
            return
        data = self.files.content(batch.input_file_id, owner=batch.owner)
        if data is None:
            missing = LineError(
                "invalid_request", f"No file {batch.input_file_id!r}.", param="input_file_id"
            )
            parsed = BatchInput(batch.endpoint, (), (missing,))
        else:
            parsed = parse_batch_input(data, batch.endpoint)
        with self.engine.begin() as conn:
            if parsed.ok:
                parsed = _within_queue(conn, batch.owner, parsed)
            if not parsed.ok:
                errors = json.dumps([e.to_openai() for e in parsed.errors])
                _cas(conn, batch_id, _S.FAILED, now, errors=errors)
                return
            if not _cas(conn, batch_id, _S.IN_PROGRESS, now):
                return
            requests = parsed.requests
            ranks = prefix_ranks(requests) if order == "prefix" else range(len(requests))
            rows = [
                {
                    "batch_id": batch_id,
                    "line": r.line,
                    "custom_id": r.custom_id,
                    "request_id": "batch_req_" + secrets.token_hex(11),
                    "body": json.dumps(r.body),
                    "state": PENDING,
                    "attempts": 0,
                    "run_order": rank,
                }
                for r, rank in zip(requests, ranks, strict=True)
            ]
            for start in range(0, len(rows), 5000):
                conn.execute(insert(s.batch_lines), rows[start : start + 5000])

    def _move(self, batch_id: str, target: BatchStatus, now: float) -> None:
        with self.engine.begin() as conn:
            if target is _S.FINALIZING:
                _cas(conn, batch_id, target, now, all_done=True)
                return
            if not _cas(conn, batch_id, target, now):
                return
            if target in _ENDED:
                code, message = _ENDED[target]
                finish_unfinished(conn, batch_id, code, message, now=now)
            if target in BATCH_TERMINAL:
                output, errors = self._write_results(conn, batch_id, now)
                conn.execute(
                    update(s.batches)
                    .where(_B.id == batch_id)
                    .values(output_file_id=output, error_file_id=errors)
                )

    def _write_results(
        self, conn: Connection, batch_id: str, now: float
    ) -> tuple[str | None, str | None]:
        """The output and error files, from the recorded lines in input order."""
        owner = conn.execute(select(_B.owner).where(_B.id == batch_id)).scalar_one()
        output, errors = (
            FileWriter(conn, owner, "batch_output", f"{batch_id}_{kind}.jsonl", now=now)
            for kind in ("output", "error")
        )
        for ok, line in output_lines(conn, batch_id):
            (output if ok else errors).write(line)
        ids = [w.close().id if w.size else None for w in (output, errors)]
        return ids[0], ids[1]

    def _batches(self, conn: Connection, query: Any) -> builtins.list[Batch]:
        rows = conn.execute(query).all()
        counts = request_counts(conn, [r.id for r in rows])
        return [_batch(r, counts.get(r.id, RequestCounts())) for r in rows]


_QUEUED: Final = (_S.IN_PROGRESS, _S.FINALIZING, _S.CANCELLING)
"""Statuses whose lines not done yet count in the tenant's batch queue."""


def _within_queue(conn: Connection, owner: str, parsed: BatchInput) -> BatchInput:
    """``parsed``, or a failed input when its lines and those the owner's unfinished batches
    still hold pass the owner's ``batch_queue`` (OpenAI fails such a batch at validation the
    same way, counting enqueued tokens)."""
    limit = conn.execute(
        select(s.tenants.c.batch_queue).where(s.tenants.c.name == owner)
    ).scalar_one_or_none()
    if limit is None:
        return parsed
    lines, batches = s.batch_lines.c, s.batches.c
    queued = conn.execute(
        select(func.count())
        .select_from(s.batch_lines.join(s.batches, batches.id == lines.batch_id))
        .where(
            batches.owner == owner,
            batches.status.in_([status.value for status in _QUEUED]),
            lines.state != DONE,
        )
    ).scalar_one()
    if queued + len(parsed.requests) <= limit:
        return parsed
    message = (
        f"Enqueued line limit reached for {owner}: limit {limit} lines in unfinished batches, "
        f"{queued} enqueued, this batch {len(parsed.requests)}. Please try again once some "
        "in_progress batches have been completed."
    )
    error = LineError("batch_queue_limit_exceeded", message)
    return BatchInput(parsed.endpoint, (), (error,))


def _cas(
    conn: Connection,
    batch_id: str,
    target: BatchStatus,
    now: float,
    *,
    all_done: bool = False,
    errors: str | None = None,
) -> bool:
    """Move the batch to ``target`` if its status allows it (and, with ``all_done``, if
    every line is done); ``True`` if this call moved it."""
    l = s.batch_lines.c  # noqa: E741
    sources = [str(x) for x in batch_sources(target)]
    where = [_B.id == batch_id, _B.status.in_(sources)]
    if all_done:
        not_done = select(l.line).where(l.batch_id == batch_id, l.state.in_([PENDING, CLAIMED]))
        where.append(not_(not_done.exists()))
    values: dict[str, Any] = {"status": str(target), BATCH_TIMESTAMPS[target]: now}
    if errors is not None:
        values["errors"] = errors
    return conn.execute(update(s.batches).where(and_(*where)).values(**values)).rowcount == 1


def _check_metadata(metadata: Mapping[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise StoreError(f"metadata has at most {MAX_METADATA_KEYS} keys")
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise StoreError("metadata keys and values are strings")
        if len(key) > 64 or len(value) > 512:
            raise StoreError("a metadata key is at most 64 characters, a value 512")


def _row(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id,
        "owner": batch.owner,
        "endpoint": batch.endpoint,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": str(batch.status),
        "created_at": batch.created_at,
        "expires_at": batch.expires_at,
        "meta": None if batch.metadata is None else json.dumps(dict(batch.metadata)),
    }


def _batch(row: Row[Any], counts: RequestCounts) -> Batch:
    m = row._mapping
    errors = tuple(LineError(**e) for e in json.loads(m["errors"])) if m["errors"] else ()
    return Batch(
        **{
            k: m[k]
            for k in (
                "id",
                "owner",
                "endpoint",
                "input_file_id",
                "completion_window",
                "created_at",
                "expires_at",
                "output_file_id",
                "error_file_id",
            )
        },
        status=BatchStatus(m["status"]),
        **{t: m[t] for t in BATCH_TIMESTAMPS.values()},
        errors=errors,
        metadata=None if m["meta"] is None else json.loads(m["meta"]),
        request_counts=counts,
    )


def _unix(t: float | None) -> int | None:
    return None if t is None else int(t)
