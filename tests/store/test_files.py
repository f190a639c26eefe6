"""``/v1/files`` in the store, on SQLite and PostgreSQL: bytes back as uploaded, each owner
sees only its own files, OpenAI's list paging."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from gpufleet.store import FileObject, Files, Store, StoreError
from gpufleet.store import _schema as schema
from gpufleet.store._files import FileWriter


def test_a_file_comes_back_as_uploaded(db: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpufleet.store._files.CHUNK_BYTES", 7)
    data = bytes(range(256)) * 3
    f = db.files.create("a", "batch", data, "in.jsonl", now=100.5)
    assert (f.bytes, f.purpose, f.filename, f.owner) == (768, "batch", "in.jsonl", "a")
    assert db.files.get(f.id, owner="a") == f
    assert db.files.content(f.id, owner="a") == data
    chunks = db.files.chunks(f.id, owner="a")
    assert chunks is not None
    assert [len(c) for c in chunks] == [7] * 109 + [5]
    assert f.to_openai() == {
        "id": f.id,
        "object": "file",
        "bytes": 768,
        "created_at": 100,
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def test_an_empty_file_and_an_awkward_name(db: Store) -> None:
    f = db.files.create("a", "batch", b"", "a\x00b\udc80.jsonl", now=1.0)
    assert db.files.content(f.id, owner="a") == b""
    assert db.files.get(f.id, owner="a") == f
    assert "\x00" not in f.filename


def test_each_owner_sees_only_its_own_files(db: Store) -> None:
    f = db.files.create("a", "batch", b"x", "in.jsonl", now=1.0)
    assert db.files.get(f.id, owner="b") is None
    assert db.files.content(f.id, owner="b") is None
    assert db.files.list("b").data == ()
    assert not db.files.delete(f.id, owner="b")
    assert db.files.delete(f.id, owner="a")
    assert not db.files.delete(f.id, owner="a")
    assert db.files.get(f.id, owner="a") is None
    with db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(schema.file_chunks)).scalar() == 0


def test_list_by_purpose_with_openai_paging(db: Store) -> None:
    made = [
        db.files.create("a", "batch" if i % 3 else "batch_output", b"x", f"{i}", now=float(i))
        for i in range(10)
    ]
    newest_first = [f for f in reversed(made) if f.purpose == "batch"]
    page = db.files.list("a", purpose="batch", limit=4)
    assert page.data == tuple(newest_first[:4])
    assert page.has_more
    rest = db.files.list("a", purpose="batch", after=page.data[-1].id, limit=4)
    assert rest.data == tuple(newest_first[4:])
    assert not rest.has_more
    ascending = db.files.list("a", order="asc", after=made[7].id)
    assert ascending.data == (made[8], made[9])
    shape = rest.to_openai()
    assert shape["object"] == "list"
    assert (shape["first_id"], shape["last_id"]) == (rest.data[0].id, rest.data[-1].id)
    assert [d["id"] for d in shape["data"]] == [f.id for f in rest.data]
    assert db.files.list("a", purpose="nothing").to_openai()["first_id"] is None


def test_bad_requests_say_why(db: Store) -> None:
    with pytest.raises(StoreError, match="purpose"):
        db.files.create("a", "fine-tune", b"", "x", now=1.0)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="at most 4 bytes"):
        Files(db.engine, max_bytes=4).create("a", "batch", b"12345", "x", now=1.0)
    with pytest.raises(StoreError, match="filename"):
        db.files.create("a", "batch", b"", "", now=1.0)
    with pytest.raises(StoreError, match="limit"):
        db.files.list("a", limit=0)
    with pytest.raises(StoreError, match="no file"):
        db.files.list("a", after="file-nope")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=8), st.integers(1, 16))
def test_a_writer_cuts_any_writes_into_whole_chunks(pieces: list[bytes], chunk: int) -> None:
    store = Store.open("sqlite://")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("gpufleet.store._files.CHUNK_BYTES", chunk)
            with store.engine.begin() as conn:
                writer = FileWriter(conn, "a", "batch_output", "out", now=1.0)
                for piece in pieces:
                    writer.write(piece)
                f: FileObject = writer.close()
            sizes = [len(c) for c in store.files.chunks(f.id, owner="a") or []]
        data = b"".join(pieces)
        assert store.files.content(f.id, owner="a") == data
        assert f.bytes == len(data)
        assert all(size == chunk for size in sizes[:-1])
        assert sum(sizes) == len(data)
    finally:
        store.close()
