"""``/v1/files`` in the store: a file's row, and its bytes in 1 MiB chunks beside it.

::

    files = store.files
    f = files.create("team-a", "batch", data, "input.jsonl", now=now)   # FileObject
    files.get(f.id, owner="team-a")            # None when absent or someone else's
    files.list("team-a", purpose="batch", after=None, limit=20)     # newest first, paged
    files.content(f.id, owner="team-a")         # the bytes, as uploaded
    files.delete(f.id, owner="team-a")          # True when it was there

Bodies live in the database, not on a disk beside it: with PostgreSQL, several gateways on
several hosts share one store, and a file uploaded through one must be readable through all
(and survive the host that took it); a row and its chunks are written in one transaction, so
a crash leaves a whole file or none. Chunks keep every value small (PostgreSQL's ``bytea``
and SQLite's blobs stay far below their limits, and ``chunks`` streams a large file).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

from sqlalchemy import Connection, Engine, and_, delete, insert, or_, select, update

from gpufleet.store import _schema as s
from gpufleet.store._errors import StoreError, clean

FilePurpose = Literal["batch", "batch_output"]
FILE_PURPOSES: Final = ("batch", "batch_output")
MAX_FILE_BYTES: Final = 200 * 1024 * 1024
"""The largest upload (OpenAI's limit for a batch input file)."""
CHUNK_BYTES: Final = 1024 * 1024
MAX_FILES_PAGE: Final = 10_000
"""The most files one list call returns (OpenAI's ``limit`` range is 1 to 10,000)."""

_F = s.files.c


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    owner: str
    purpose: FilePurpose
    filename: str
    bytes: int
    created_at: float

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass(frozen=True, slots=True)
class FilePage:
    data: tuple[FileObject, ...]
    has_more: bool

    def to_openai(self) -> dict[str, Any]:
        return page_json(self.data, self.has_more)


class Files:
    """The files of one database, each visible only to its owner (a tenant)."""

    def __init__(self, engine: Engine, *, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.engine = engine
        self.max_bytes = max_bytes

    def create(
        self, owner: str, purpose: FilePurpose, data: bytes, filename: str, *, now: float
    ) -> FileObject:
        if purpose not in FILE_PURPOSES:
            raise StoreError(f"purpose must be one of {', '.join(FILE_PURPOSES)}")
        if len(data) > self.max_bytes:
            raise StoreError(f"a file is at most {self.max_bytes} bytes; this one is {len(data)}")
        if not 0 < len(filename) <= 512:
            raise StoreError("a filename is 1 to 512 characters")
        with self.engine.begin() as conn:
            writer = FileWriter(conn, owner, purpose, clean(filename), now=now)
            writer.write(data)
            return writer.close()

    def get(self, file_id: str, *, owner: str) -> FileObject | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(s.files).where(_F.id == file_id, _F.owner == owner)).first()
        return None if row is None else _file(row)

    def list(
        self,
        owner: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = MAX_FILES_PAGE,
        order: Literal["asc", "desc"] = "desc",
    ) -> FilePage:
        """``owner``'s files by creation time, ``limit`` of them after the file ``after``."""
        if not 1 <= limit <= MAX_FILES_PAGE:
            raise StoreError(f"limit must be 1 to {MAX_FILES_PAGE}")
        query = select(s.files).where(_F.owner == owner)
        if purpose is not None:
            query = query.where(_F.purpose == purpose)
        with self.engine.connect() as conn:
            if after is not None:
                cursor = conn.execute(
                    select(_F.created_at, _F.id).where(_F.id == after, _F.owner == owner)
                ).first()
                if cursor is None:
                    raise StoreError(f"no file {after!r}")
                query = query.where(after_cursor(_F.created_at, _F.id, cursor, order))
            keys = (_F.created_at, _F.id)
            ordered = keys if order == "asc" else tuple(k.desc() for k in keys)
            rows = conn.execute(query.order_by(*ordered).limit(limit + 1)).all()
        return FilePage(tuple(_file(r) for r in rows[:limit]), len(rows) > limit)

    def delete(self, file_id: str, *, owner: str) -> bool:
        with self.engine.begin() as conn:
            gone = conn.execute(delete(s.files).where(_F.id == file_id, _F.owner == owner))
            if gone.rowcount == 1:
                conn.execute(delete(s.file_chunks).where(s.file_chunks.c.file_id == file_id))
        return gone.rowcount == 1

    def content(self, file_id: str, *, owner: str) -> bytes | None:
        chunks = self.chunks(file_id, owner=owner)
        return None if chunks is None else b"".join(chunks)

    def chunks(self, file_id: str, *, owner: str) -> Iterator[bytes] | None:
        """The file's bytes a chunk at a time (one short query each), or ``None``."""
        if self.get(file_id, owner=owner) is None:
            return None
        return self._chunks(file_id)

    def _chunks(self, file_id: str) -> Iterator[bytes]:
        c = s.file_chunks.c
        seq = -1
        while True:
            with self.engine.connect() as conn:
                row = conn.execute(
                    select(c.seq, c.data)
                    .where(c.file_id == file_id, c.seq > seq)
                    .order_by(c.seq)
                    .limit(1)
                ).first()
            if row is None:
                return
            seq = row.seq
            yield bytes(row.data)


class FileWriter:
    """A file written on the caller's transaction (``conn``) a chunk at a time: appended
    bytes are cut into :data:`CHUNK_BYTES` chunks; the row is inserted at the first chunk or
    at :meth:`close`, whichever comes first."""

    def __init__(
        self, conn: Connection, owner: str, purpose: FilePurpose, filename: str, *, now: float
    ) -> None:
        self.conn = conn
        self.file = FileObject("file-" + secrets.token_hex(12), owner, purpose, filename, 0, now)
        self.size = 0
        self._buffer = bytearray()
        self._seq = 0
        self._inserted = False

    def write(self, data: bytes) -> None:
        self.size += len(data)
        view = memoryview(data)
        if self._buffer:
            take = CHUNK_BYTES - len(self._buffer)
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) < CHUNK_BYTES:
                return
            self._flush(bytes(self._buffer))
            self._buffer.clear()
        while len(view) >= CHUNK_BYTES:
            self._flush(bytes(view[:CHUNK_BYTES]))
            view = view[CHUNK_BYTES:]
        self._buffer += view

    def close(self) -> FileObject:
        if self._buffer:
            self._flush(bytes(self._buffer))
            self._buffer.clear()
        self._insert()
        self.conn.execute(update(s.files).where(_F.id == self.file.id).values(bytes=self.size))
        return dataclasses.replace(self.file, bytes=self.size)

    def _flush(self, chunk: bytes) -> None:
        self._insert()
        c = s.file_chunks.c
        self.conn.execute(
            insert(s.file_chunks).values({c.file_id: self.file.id, c.seq: self._seq, c.data: chunk})
        )
        self._seq += 1

    def _insert(self) -> None:
        if not self._inserted:
            f = self.file
            self.conn.execute(
                insert(s.files).values(
                    id=f.id,
                    owner=f.owner,
                    purpose=f.purpose,
                    filename=f.filename,
                    bytes=0,
                    created_at=f.created_at,
                )
            )
            self._inserted = True


def after_cursor(time_col: Any, id_col: Any, cursor: Any, order: str) -> Any:
    """Rows strictly after ``cursor`` = (time, id) in (time, id) order, ascending or not."""
    time_value, id_value = cursor
    if order == "asc":
        return or_(time_col > time_value, and_(time_col == time_value, id_col > id_value))
    return or_(time_col < time_value, and_(time_col == time_value, id_col < id_value))


def page_json(data: tuple[Any, ...], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [item.to_openai() for item in data],
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
        "has_more": has_more,
    }


def _file(row: Any) -> FileObject:
    return FileObject(row.id, row.owner, row.purpose, row.filename, row.bytes, row.created_at)
