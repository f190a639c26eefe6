"""``/v1/files`` and ``/v1/batches``: the OpenAI Batch API over the store (docs/batch.md).

::

    POST   /v1/files                      upload a JSONL file (multipart: purpose=batch, file)
    GET    /v1/files[?purpose&limit&order&after]              the caller's files, a page
    GET    /v1/files/{id}        DELETE /v1/files/{id}         one file; remove it
    GET    /v1/files/{id}/content                             its bytes, as uploaded
    POST   /v1/batches                    {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches[?limit&after]      GET /v1/batches/{id}  the caller's batches
    POST   /v1/batches/{id}/cancel

The routes only translate: the store holds the objects in OpenAI's JSON shape and enforces
ownership (a tenant sees its own files and batches; with auth off everything belongs to
:data:`ANONYMOUS`), and the runner (``_batch_runner``) moves batches along. Every store call
runs in a worker thread, so the event loop never waits for the database. Errors are raised
as the gateway's error tree and answered by the app's one error handler.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, Final
from urllib.parse import parse_qsl

from gpufleet.fleet import parse_batch_input
from gpufleet.gateway._errors import (
    BadRequestError,
    ConflictError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
    RouteNotFoundError,
)
from gpufleet.gateway._multipart import FormError, parse_form
from gpufleet.gateway._tenancy import PRINCIPAL
from gpufleet.store import MAX_BATCHES_PAGE, MAX_FILES_PAGE, Store, StoreError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Header = tuple[bytes, bytes]

ANONYMOUS: Final = "anonymous"
"""The owner of every file and batch when auth is off."""
PREFIXES: Final = ("/v1/files", "/v1/batches")
FORM_SLACK: Final = 64 * 1024
"""Bytes of multipart framing (boundaries, part headers, the purpose) allowed on top of the
largest file."""
MAX_JSON_BODY: Final = 1024 * 1024
"""A batch's creation request (its metadata is at most 16 short pairs)."""
SHOWN_ERRORS: Final = 10
"""Line errors named in the message of a refused upload."""

_ROUTES: Final = (
    (re.compile(r"/v1/files"), {"GET": "list_files", "POST": "upload"}),
    (re.compile(r"/v1/files/([A-Za-z0-9_-]{1,64})"), {"GET": "get_file", "DELETE": "delete_file"}),
    (re.compile(r"/v1/files/([A-Za-z0-9_-]{1,64})/content"), {"GET": "file_content"}),
    (re.compile(r"/v1/batches"), {"GET": "list_batches", "POST": "create_batch"}),
    (re.compile(r"/v1/batches/([A-Za-z0-9_-]{1,64})"), {"GET": "get_batch"}),
    (re.compile(r"/v1/batches/([A-Za-z0-9_-]{1,64})/cancel"), {"POST": "cancel_batch"}),
)


def batch_path(path: str) -> bool:
    """Whether ``path`` is one of this module's (the app hands those over)."""
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


class BatchApi:
    """The routes over one store. ``wake`` tells the runner to look at once (a batch was
    created or cancelled); ``wall`` is the clock of the objects' Unix times."""

    def __init__(
        self,
        store: Store,
        *,
        wake: Callable[[], None],
        body_timeout: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._wake = wake
        self._body_timeout = body_timeout
        self._wall = wall

    async def handle(self, scope: Scope, receive: Receive, send: Send, rid: Header) -> None:
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        for pattern, methods in _ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            name = methods.get(method)
            if name is None:
                raise MethodNotAllowedError(f"{method} is not allowed on {path}")
            call = Call(scope, receive, _owner(scope), match.groups())
            status, body, kind = await getattr(self, name)(call)
            await _answer(send, rid, status, body, kind)
            return
        raise RouteNotFoundError(f"no route {method} {path}")

    # -- files --------------------------------------------------------------------------

    async def upload(self, call: Call) -> Answer:
        limit = self.store.files.max_bytes + FORM_SLACK
        body = await call.body(limit, self._body_timeout)
        content_type = call.header(b"content-type") or ""
        try:
            parts = parse_form(body, content_type)
        except FormError as error:
            raise BadRequestError(str(error)) from None
        purpose = parts.get("purpose")
        upload = parts.get("file")
        if purpose is None or upload is None:
            raise BadRequestError("a file upload has the form fields `purpose` and `file`")
        if purpose.data != b"batch":
            raise BadRequestError("`purpose` must be `batch` (the only purpose served here)")
        if not upload.filename:
            raise BadRequestError("`file` must be a file, with a filename")
        data = upload.data
        if len(data) > self.store.files.max_bytes:
            raise PayloadTooLargeError(f"a file is at most {self.store.files.max_bytes} bytes")
        parsed = await asyncio.to_thread(parse_batch_input, data)
        if not parsed.ok:
            raise BadRequestError(_line_errors(parsed.errors))
        created = await _store(
            self.store.files.create,
            call.owner,
            "batch",
            data,
            upload.filename[:512],
            now=self._wall(),
        )
        return 200, created.to_openai(), None

    async def list_files(self, call: Call) -> Answer:
        query = call.query()
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequestError("`order` must be `asc` or `desc`")
        page = await _store(
            self.store.files.list,
            call.owner,
            purpose=query.get("purpose"),
            after=query.get("after"),
            limit=_limit(query, MAX_FILES_PAGE, MAX_FILES_PAGE),
            order="asc" if order == "asc" else "desc",
        )
        return 200, page.to_openai(), None

    async def get_file(self, call: Call) -> Answer:
        found = await _store(self.store.files.get, call.args[0], owner=call.owner)
        if found is None:
            raise NotFoundError(f"No such File object: {call.args[0]}")
        return 200, found.to_openai(), None

    async def delete_file(self, call: Call) -> Answer:
        file_id = call.args[0]
        if not await _store(self.store.files.delete, file_id, owner=call.owner):
            raise NotFoundError(f"No such File object: {file_id}")
        return 200, {"id": file_id, "object": "file", "deleted": True}, None

    async def file_content(self, call: Call) -> Answer:
        file_id = call.args[0]
        found = await _store(self.store.files.get, file_id, owner=call.owner)
        chunks = await _store(self.store.files.chunks, file_id, owner=call.owner)
        if found is None or chunks is None:
            raise NotFoundError(f"No such File object: {file_id}")
        return 200, _Streamed(found.bytes, chunks), None

    # -- batches ------------------------------------------------------------------------

    async def create_batch(self, call: Call) -> Answer:
        body = await call.body(MAX_JSON_BODY, self._body_timeout)
        try:
            payload = json.loads(body)
        except ValueError as error:
            raise BadRequestError(f"the body is not valid JSON: {error}") from None
        if not isinstance(payload, dict):
            raise BadRequestError("the body must be a JSON object")
        fields = {}
        for name in ("input_file_id", "endpoint", "completion_window"):
            value = payload.get(name)
            if not isinstance(value, str):
                raise BadRequestError(f"`{name}` is required (a string)")
            fields[name] = _text(value, name)
        metadata = payload.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise BadRequestError("`metadata` must be an object of strings")
        batch = await _store(
            self.store.batches.create,
            call.owner,
            fields["input_file_id"],
            fields["endpoint"],
            completion_window=fields["completion_window"],
            metadata=metadata,
            now=self._wall(),
        )
        self._wake()
        return 200, batch.to_openai(), None

    async def list_batches(self, call: Call) -> Answer:
        query = call.query()
        page = await _store(
            self.store.batches.list,
            call.owner,
            after=query.get("after"),
            limit=_limit(query, 20, MAX_BATCHES_PAGE),
        )
        return 200, page.to_openai(), None

    async def get_batch(self, call: Call) -> Answer:
        found = await _store(self.store.batches.get, call.args[0], owner=call.owner)
        if found is None:
            raise NotFoundError(f"No such Batch object: {call.args[0]}")
        return 200, found.to_openai(), None

    async def cancel_batch(self, call: Call) -> Answer:
        batch_id = call.args[0]
        cancel = self.store.batches.cancel
        try:
            found = await asyncio.to_thread(cancel, batch_id, owner=call.owner, now=self._wall())
        except StoreError as error:
            raise ConflictError(str(error)) from None
        if found is None:
            raise NotFoundError(f"No such Batch object: {batch_id}")
        self._wake()
        return 200, found.to_openai(), None


Answer = tuple[int, Any, bytes | None]


class Call:
    """One request to a route: its scope, its owner and the path's arguments."""

    __slots__ = ("args", "owner", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive, owner: str, args: tuple[str, ...]) -> None:
        self.scope = scope
        self.receive = receive
        self.owner = owner
        self.args = args

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return str(value.decode("latin-1"))
        return None

    def query(self) -> dict[str, str]:
        text = self.scope.get("query_string", b"").decode("latin-1")
        pairs = parse_qsl(text, keep_blank_values=True)
        return {k: _text(v, k) for k, v in reversed(pairs)}  # the first wins

    async def body(self, limit: int, timeout: float) -> bytes:
        """The whole request body: 413 over ``limit`` (from ``content-length`` before any
        byte is read), 408 if it takes longer than ``timeout``."""
        length = self.header(b"content-length")
        if length is not None and _whole(length) and int(length) > limit:
            raise PayloadTooLargeError(f"request body over {limit} bytes")
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await self.receive()
                    if message["type"] == "http.disconnect":  # the answer goes nowhere
                        raise BadRequestError("the client left while sending its body")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLargeError(f"request body over {limit} bytes")
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request body did not arrive within {timeout:g} s"
            ) from None


class _Streamed:
    """A file's bytes, sent a chunk at a time as the store reads them."""

    def __init__(self, size: int, chunks: Iterator[bytes]) -> None:
        self.size = size
        self.chunks = chunks


async def _answer(send: Send, rid: Header, status: int, body: Any, kind: bytes | None) -> None:
    if isinstance(body, _Streamed):
        headers = [
            (b"content-type", kind or b"application/octet-stream"),
            (b"content-length", b"%d" % body.size),
            rid,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        while (chunk := await asyncio.to_thread(next, body.chunks, None)) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", kind or b"application/json"),
        (b"content-length", b"%d" % len(data)),
        rid,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _store(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A store call in a worker thread; its refusals are the client's 400."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except StoreError as error:
        raise BadRequestError(str(error)) from None


def _owner(scope: Scope) -> str:
    principal = scope.get(PRINCIPAL)
    return ANONYMOUS if principal is None else str(principal.tenant)


def _limit(query: dict[str, str], default: int, most: int) -> int:
    text = query.get("limit")
    if text is None:
        return default
    if not _whole(text) or not 1 <= int(text) <= most:
        raise BadRequestError(f"`limit` must be a whole number from 1 to {most}")
    return int(text)


def _text(value: str, name: str) -> str:
    """``value`` if every database can hold it (UTF-8, no NUL), else the client's 400."""
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate, which a JSON string can spell
        raise BadRequestError(f"`{name}` must be UTF-8 text") from None
    if "\x00" in value:  # PostgreSQL's text holds no NUL
        raise BadRequestError(f"`{name}` must not hold NUL characters")
    return value


def _whole(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 12


def _line_errors(errors: Any) -> str:
    shown = [
        ("" if e.line is None else f"line {e.line}: ") + f"{e.message} ({e.code})"
        for e in errors[:SHOWN_ERRORS]
    ]
    more = f"; and {len(errors) - SHOWN_ERRORS} more" if len(errors) > SHOWN_ERRORS else ""
    return "The file is not a valid batch input: " + "; ".join(shown) + more
