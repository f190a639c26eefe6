"""The write-ahead journal: how a ledger record survives ``kill -9`` without a database
commit on the hot path.

Decision. A completed request's record is appended to a local file with one ``os.write``
(a few microseconds) *before* the response's last byte goes to the client. After a
``write`` returns, the bytes are in the kernel's page cache: killing the process, even with
SIGKILL, cannot lose them (only a power failure or a kernel crash can, and the flusher
``fsync``s the file every ``flush_interval`` to bound that window). A background thread
moves the journal into the database in batches (one transaction per interval, many rows)
and deletes what it committed. A restarted writer first replays whatever a dead one left.

The alternative, a synchronous SQLite commit batched every few milliseconds with the client
waiting for it, would put a commit latency (and for PostgreSQL a network round trip) in front
of every response's end, and would not survive the database being briefly unreachable.

Layout: ``<dir>/<writer uuid>/`` holds a ``lock`` file (held with ``flock`` while the writer
lives: recovery skips a live writer's journal), the ``open.jsonl`` being appended, and
``sealed-<n>.jsonl`` files rotated out for the flusher. A record is one JSON line
``{"k": kind, "r": row}``; a torn last line (impossible for a SIGKILL between two writes,
possible after a power failure) is skipped. Replays are idempotent: every row has a unique
primary key and inserts skip rows already present.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

logger = logging.getLogger("gpufleet.store")

Record = tuple[str, dict[str, Any]]
Sink = Callable[[Sequence[Record]], None]
"""Commits a batch of records in one transaction (raises if it could not)."""

_OPEN: Final = "open.jsonl"


def _encode(kind: str, row: dict[str, Any]) -> bytes:
    return json.dumps({"k": kind, "r": row}, separators=(",", ":")).encode() + b"\n"


def read_records(path: Path) -> Iterator[Record]:
    """The records of one journal file; a torn or garbled line is skipped."""
    with path.open("rb") as file:
        for line in file:
            try:
                entry = json.loads(line)
                yield str(entry["k"]), dict(entry["r"])
            except (ValueError, KeyError, TypeError):
                logger.warning("journal %s: skipped a torn record", path)


def recover(root: Path, sink: Sink, *, batch: int = 1000) -> int:
    """Replay the journals of writers that are gone into ``sink``; the number of records."""
    count = 0
    if not root.is_dir():
        return 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        lock = folder / "lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer's journal
            files = [*sorted(folder.glob("sealed-*.jsonl"), key=_seq), folder / _OPEN]
            pending: list[Record] = []
            for path in files:
                if path.exists():
                    pending.extend(read_records(path))
            for start in range(0, len(pending), batch):
                sink(pending[start : start + batch])
            count += len(pending)
            shutil.rmtree(folder)
        finally:
            os.close(fd)
    return count


def _seq(path: Path) -> int:
    return int(path.stem.removeprefix("sealed-"))


class Journal:
    """One writer's journal and the thread that flushes it into ``sink``.

    ``append`` is called on the event loop's thread (it takes a lock the flusher holds only
    to swap the file, microseconds: the fsync of the sealed file happens outside it);
    ``close`` flushes what is left.
    """

    def __init__(self, root: Path, sink: Sink, *, flush_interval: float = 0.05) -> None:
        self._root = root
        self._sink = sink
        self._interval = flush_interval
        self._dir = root / uuid.uuid4().hex
        self._lock = threading.Lock()
        """Guards the open file and ``_pending``: ``append`` takes it, for microseconds."""
        self._flushing = threading.Lock()
        """Serialises flushes (they own ``_unflushed`` and ``_sealed``)."""
        self._pending: list[Record] = []
        self._unflushed: list[Record] = []
        self._sealed: list[Path] = []
        self._seq = 0
        self._written = False
        self._fd = -1
        self._lock_fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        """Flushes that failed (the records stay journaled and are tried again)."""

    def start(self) -> int:
        """Replay dead writers' journals, open this one, start the flusher; replayed count."""
        self._root.mkdir(parents=True, exist_ok=True)
        replayed = recover(self._root, self._sink)
        self._dir.mkdir()
        self._lock_fd = os.open(self._dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._fd = self._open()
        self._thread = threading.Thread(target=self._run, name="gpufleet-journal", daemon=True)
        self._thread.start()
        return replayed

    def _open(self) -> int:
        return os.open(self._dir / _OPEN, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, kind: str, row: dict[str, Any]) -> None:
        """Journal one record; when this returns, a ``kill -9`` cannot lose it."""
        line = _encode(kind, row)
        with self._lock:
            os.write(self._fd, line)
            self._pending.append((kind, row))
            self._written = True

    def flush(self) -> None:
        """Move what was appended into the sink (the flusher calls this every interval).

        Flushes run one at a time: a caller's flush (``close``, a test) waits for the flusher's
        batch in progress, so when it returns everything appended before it is in the sink."""
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        old_fd = -1
        with self._lock:
            batch, self._pending = self._pending, []
            if self._written:
                # rotate: the sealed file holds exactly the records of this batch and earlier
                # unflushed ones, so it can go once they are committed. Only the swap is under
                # the lock; the fsync (milliseconds on a busy disk) is not, so ``append`` on
                # the event loop never waits for the disk.
                self._seq += 1
                sealed = self._dir / f"sealed-{self._seq}.jsonl"
                os.rename(self._dir / _OPEN, sealed)
                self._sealed.append(sealed)
                old_fd, self._fd = self._fd, self._open()
                self._written = False
        if old_fd >= 0:
            os.fsync(old_fd)
            os.close(old_fd)
        self._unflushed.extend(batch)
        if not self._unflushed:
            return
        try:
            self._sink(self._unflushed)
        except Exception:
            self.failures += 1
            logger.exception("could not flush %d journaled records; will retry", len(batch))
            return
        self._unflushed = []
        for path in self._sealed:
            path.unlink(missing_ok=True)
        self._sealed = []

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def close(self) -> None:
        """Stop the flusher, flush the rest, remove the journal if all of it was committed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd < 0:
            return
        self.flush()
        os.close(self._fd)
        self._fd = -1
        if not self._unflushed:
            shutil.rmtree(self._dir, ignore_errors=True)
        os.close(self._lock_fd)  # releases the flock: a later writer replays what is left
        self._lock_fd = -1
