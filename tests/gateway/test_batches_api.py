"""``/v1/files`` and ``/v1/batches`` with the official ``openai`` client over loopback: the
whole API as a client uses it, OpenAI-shaped errors with the right statuses, the upload's
size limits, and tenancy (a tenant sees only its own files and batches)."""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from gpufleet.store import Store, TenantSettings
from tests.gateway.batches import (
    CHAT,
    input_lines,
    jsonl,
    serve_batch_gateway,
    slow_replica,
    upload,
    wait_ended,
)
from tests.gateway.conftest import MODEL, fleet, sim_replica
from tests.gateway.tenants import serve_tenant_gateway, tenant_fleet

FAST_POLL = {"batch": {"poll_interval": 0.1}}


def test_files_and_a_batch_with_the_official_client(tmp_path: Path) -> None:
    data = input_lines(50)
    with (
        sim_replica() as url,
        serve_batch_gateway(tmp_path, fleet(gateway=FAST_POLL), [url]) as gw,
        openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client,
    ):
        first = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert (first.object, first.purpose, first.bytes) == ("file", "batch", len(data))
        assert first.filename == "in.jsonl"
        second = upload(client, input_lines(2, prefix="s"), "second.jsonl")
        assert client.files.retrieve(first.id) == first
        assert client.files.content(first.id).content == data
        listed = client.files.list()
        assert [f.id for f in listed.data] == [second, first.id]  # newest first
        page = client.files.list(limit=1, order="asc")
        assert [f.id for f in page.data] == [first.id]
        assert page.has_more
        assert [f.id for f in client.files.list(after=first.id, order="asc").data] == [second]
        assert client.files.list(purpose="batch_output").data == []

        batch = client.batches.create(
            input_file_id=first.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert batch.status == "validating"
        assert batch.metadata == {"job": "nightly"}
        done = wait_ended(client, batch.id)
        assert done.status == "completed", done
        counts = done.request_counts
        assert counts is not None
        assert (counts.total, counts.completed, counts.failed) == (50, 50, 0)
        assert done.in_progress_at is not None
        assert done.finalizing_at is not None
        assert done.completed_at is not None
        assert done.error_file_id is None
        out = jsonl(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"r-{i}" for i in range(50)]
        for o in out:
            assert o["id"].startswith("batch_req_")
            assert o["error"] is None
            assert o["response"]["status_code"] == 200
            assert o["response"]["body"]["object"] == "chat.completion"
            assert o["response"]["body"]["usage"]["completion_tokens"] == 4
        output = client.files.retrieve(done.output_file_id or "")
        assert output.purpose == "batch_output"
        assert [b.id for b in client.batches.list().data] == [batch.id]
        # the lines were copied out: deleting the input file leaves the batch whole
        assert client.files.delete(first.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(first.id)
        assert client.batches.retrieve(batch.id).request_counts == counts
        with pytest.raises(openai.ConflictError, match="completed"):
            client.batches.cancel(batch.id)
        assert gw.sample("gpufleet:gateway_batch_lines_total", outcome="completed") == 50
        assert gw.sample("gpufleet:gateway_requests_total", model=MODEL, status="200") == 50


def test_a_batch_whose_lines_do_not_match_its_endpoint_fails(tmp_path: Path) -> None:
    with (
        sim_replica() as url,
        serve_batch_gateway(tmp_path, fleet(gateway=FAST_POLL), [url]) as gw,
        openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client,
    ):
        file_id = upload(client, input_lines(3))
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        done = wait_ended(client, batch.id)
        assert done.status == "failed"
        assert done.errors is not None
        errors = done.errors.data or []
        assert [(e.code, e.line) for e in errors] == [("invalid_url", n) for n in (1, 2, 3)]
        assert done.output_file_id is None


def test_bad_requests_get_openai_errors(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    store.files.max_bytes = 4096
    with (
        sim_replica() as url,
        serve_batch_gateway(tmp_path, fleet(), [url], store=store) as gw,
        openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client,
    ):
        good = upload(client, input_lines(1))
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("a.jsonl", io.BytesIO(input_lines(1))), purpose="fine-tune")
        bad = input_lines(1) + b"not json\n\n" + b'{"custom_id": "x"}\n'
        with pytest.raises(openai.BadRequestError) as refused:
            upload(client, bad)
        message = refused.value.message
        assert "line 2: " in message
        assert "(invalid_json_line)" in message
        assert "line 4: " in message
        with pytest.raises(openai.BadRequestError, match="empty_file"):
            upload(client, b"\n\n")
        with pytest.raises(openai.APIStatusError) as too_large:
            upload(client, input_lines(40))
        assert too_large.value.status_code == 413
        for call in (
            lambda: client.files.retrieve("file-nope"),
            lambda: client.files.content("file-nope"),
            lambda: client.files.delete("file-nope"),
            lambda: client.batches.retrieve("batch_nope"),
            lambda: client.batches.cancel("batch_nope"),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        for kwargs, match in (
            ({"endpoint": "/v1/embeddings"}, "endpoint"),
            ({"completion_window": "1h"}, "completion_window"),
            ({"input_file_id": "file-nope"}, "no file"),
            ({"metadata": {"k": 1}}, "metadata"),
        ):
            args = {"input_file_id": good, "endpoint": CHAT, "completion_window": "24h", **kwargs}
            with pytest.raises(openai.BadRequestError, match=match):
                client.batches.create(**args)  # type: ignore[arg-type]

        def answer(method: str, path: str, **kwargs: object) -> tuple[int, dict[str, object]]:
            response = httpx.request(method, gw.url + path, **kwargs)  # type: ignore[arg-type]
            return response.status_code, response.json()["error"]

        for path in ("/v1/files?limit=0", "/v1/files?limit=x", "/v1/files?order=sideways"):
            status, error = answer("GET", path)
            assert status == 400
            assert error["type"] == "invalid_request_error"
        assert answer("GET", "/v1/batches?limit=101")[0] == 400
        assert answer("GET", "/v1/batches?after=batch_nope")[0] == 400
        assert answer("PUT", "/v1/files")[0] == 405
        assert answer("DELETE", "/v1/batches/batch_x")[0] == 405
        assert answer("GET", "/v1/files/a/b")[0] == 404
        assert answer("POST", "/v1/batches", content=b"{")[0] == 400
        assert answer("POST", "/v1/batches", json=[1])[0] == 400
        assert answer("POST", "/v1/batches", json={"endpoint": CHAT})[0] == 400
        # text no database can hold (a lone surrogate, NUL) is the client's error, not a 500
        surrogate = b'{"input_file_id": "\\ud800", "endpoint": "%s", "completion_window": "24h"}'
        assert answer("POST", "/v1/batches", content=surrogate % CHAT.encode())[0] == 400
        assert answer("GET", "/v1/files?after=%00")[0] == 400
        assert answer("POST", "/v1/files", content=b"x")[0] == 400  # not multipart
        form = {"purpose": "batch"}
        assert answer("POST", "/v1/files", data=form, files={"x": ("a", b"1")})[0] == 400
        status, error = answer("POST", "/v1/files", data=form, files={"file": ("", b"1")})
        assert status == 400
        # refused from its content-length, before its body arrives (the route's own limit)
        assert head_only(gw.url, "/v1/files", 100_000) == 413
        assert json.loads(client.files.content(good).content.splitlines()[0])["custom_id"] == "r-0"
    store.close()


def test_an_upload_over_the_servers_body_limit_is_taken_on_files_only(tmp_path: Path) -> None:
    """The gateway's server refuses bodies over 32 MiB; ``/v1/files`` takes a batch input
    file up to the store's 200 MiB (and refuses more from its content-length)."""
    line = json.dumps(
        {
            "custom_id": "big",
            "method": "POST",
            "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2**20}]},
        }
    ).encode()
    data = b"".join(line.replace(b'"big"', b'"big-%d"' % i) + b"\n" for i in range(33))
    assert len(data) > 32 * 2**20
    with (
        sim_replica() as url,
        serve_batch_gateway(tmp_path, fleet(), [url]) as gw,
        openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client,
    ):
        created = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
        assert created.bytes == len(data)
        assert client.files.content(created.id).content == data
        assert head_only(gw.url, "/v1/files", 202 * 2**20) == 413  # the server's limit
        assert httpx.post(gw.v1 + "/completions", content=data).status_code == 413


def head_only(base: str, path: str, length: int) -> int:
    """The status of a POST that announces ``length`` bytes of body and sends none."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; "
            f"boundary=b\r\ncontent-length: {length}\r\n\r\n".encode()
        )
        return int(sock.recv(1024).split(b" ")[1])


def test_a_tenant_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    config = tenant_fleet(gateway=FAST_POLL)
    with sim_replica() as url, serve_tenant_gateway(tmp_path, config, [url]) as gw:
        _, key_a = gw.store.create_key("team-a")
        _, key_b = gw.store.create_key("team-b")
        gw.tenancy.reload()
        a = openai.OpenAI(base_url=gw.v1, api_key=key_a, max_retries=0)
        b = openai.OpenAI(base_url=gw.v1, api_key=key_b, max_retries=0)
        file_a = upload(a, input_lines(5))
        batch_a = a.batches.create(input_file_id=file_a, endpoint=CHAT, completion_window="24h")
        for call in (
            lambda: b.files.retrieve(file_a),
            lambda: b.files.content(file_a),
            lambda: b.files.delete(file_a),
            lambda: b.batches.retrieve(batch_a.id),
            lambda: b.batches.cancel(batch_a.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError, match="no file"):
            b.batches.create(input_file_id=file_a, endpoint=CHAT, completion_window="24h")
        assert b.files.list().data == []
        assert b.batches.list().data == []
        done = wait_ended(a, batch_a.id)
        assert done.status == "completed"
        with pytest.raises(openai.NotFoundError):
            b.files.content(done.output_file_id or "")
        assert [o["custom_id"] for o in jsonl(a, done.output_file_id)] == [
            f"r-{i}" for i in range(5)
        ]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gw.v1, api_key="nope", max_retries=0).files.list()
        a.close()
        b.close()


def test_a_tenants_batch_queue_fails_a_batch_past_it_with_openais_error(tmp_path: Path) -> None:
    """A tenant with ``batch_queue`` 8: a 5-line batch runs; a second 5-line batch fails at
    validation with ``batch_queue_limit_exceeded`` in its ``errors``, as OpenAI fails one
    past its enqueued limit; cancel the first, and the next one runs."""
    config = tenant_fleet(gateway=FAST_POLL)
    with slow_replica(1.0) as url, serve_tenant_gateway(tmp_path, config, [url]) as gw:
        _, key = gw.store.create_key("team-a", TenantSettings(batch_queue=8))
        gw.tenancy.reload()
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            slow = upload(client, input_lines(5, max_tokens=2000))
            first = client.batches.create(
                input_file_id=slow, endpoint=CHAT, completion_window="24h"
            )
            deadline = time.monotonic() + 10
            while client.batches.retrieve(first.id).status == "validating":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            second = client.batches.create(
                input_file_id=upload(client, input_lines(5)), endpoint=CHAT, completion_window="24h"
            )
            failed = wait_ended(client, second.id)
            assert failed.status == "failed"
            assert failed.errors is not None
            assert [e.code for e in failed.errors.data or []] == ["batch_queue_limit_exceeded"]
            assert client.batches.retrieve(first.id).status == "in_progress"
            client.batches.cancel(first.id)
            wait_ended(client, first.id)
            third = client.batches.create(
                input_file_id=upload(client, input_lines(5)), endpoint=CHAT, completion_window="24h"
            )
            assert wait_ended(client, third.id).status == "completed"
