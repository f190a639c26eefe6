"""The gateway's own HTTP/1.1 upstream client against small real asyncio servers on
127.0.0.1:0, each scripted byte by byte: kept-alive reuse, a connection the replica closed
while idle, ``content-length`` and ``chunked`` answers (with trailers, split anywhere), a
refused connection, an answer cut short."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gpufleet.fleet import Outcome
from gpufleet.gateway import LocalOriginError, UpstreamRequest
from gpufleet.gateway._http11 import Http11ReplicaClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """Serves ``handler(reader, writer, n)`` per request (``n`` counts them all); records
    the connections it accepted and the raw requests it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer, len(self.requests))
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, Server]]:
    server = Server(handler)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield f"http://127.0.0.1:{port}", server


def request(url: str, body: bytes = b'{"x":1}') -> UpstreamRequest:
    return UpstreamRequest(url, "/v1/completions", body, [("content-type", "application/json")])


async def fetch(client: Http11ReplicaClient, url: str) -> tuple[int, list[bytes]]:
    async with client.send(request(url)) as response:
        return response.status, [chunk async for chunk in response.chunks]


async def answer(writer: asyncio.StreamWriter, *parts: bytes, gap: float = 0.0) -> None:
    for part in parts:
        writer.write(part)
        await writer.drain()
        if gap:
            await asyncio.sleep(gap)


LENGTH_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"


@pytest.mark.asyncio
async def test_a_content_length_answer_and_the_connection_is_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(writer, LENGTH_ANSWER, b'{"ok":', b"true}", gap=0.01)

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:
        for _ in range(3):
            async with client.send(request(url)) as response:
                assert response.status == 200
                assert (b"content-type", b"application/json") in response.headers
                assert b"".join([c async for c in response.chunks]) == b'{"ok":true}'
        assert server.connections == 1
        raw = server.requests[0]
        assert raw.startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"\r\ncontent-length: 7\r\n\r\n" in raw
        assert raw.endswith(b'{"x":1}')
        assert await client.get(url + "/health", 1.0) == (200, b'{"ok":true}')


@pytest.mark.asyncio
async def test_a_chunked_answer_with_trailers_split_anywhere() -> None:
    whole = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"\r\n7\r\ndata: a\r\n9;ext=1\r\ndata: bcd\r\n0\r\nx-trailer: yes\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:  # byte by byte
            await answer(writer, *(whole[i : i + 1] for i in range(len(whole))), gap=0.001)
        else:  # all at once
            await answer(writer, whole)

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:
        status, chunks = await fetch(client, url)
        assert status == 200
        assert b"".join(chunks) == b"data: adata: bcd"
        status, chunks = await fetch(client, url)
        assert chunks == [b"data: adata: bcd"]  # one read, one piece
        assert server.connections == 1  # trailers read: the connection was reusable


@pytest.mark.asyncio
async def test_a_kept_alive_connection_closed_while_idle_is_sent_again() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(writer, LENGTH_ANSWER + b'{"ok":true}')
        writer.close()  # the replica ends the kept-alive connection after each answer

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:
        assert await fetch(client, url) == (200, [b'{"ok":true}'])
        await asyncio.sleep(0.05)
        assert await fetch(client, url) == (200, [b'{"ok":true}'])
        assert server.connections == 2
        assert len(server.requests) == 2


@pytest.mark.asyncio
async def test_a_refused_connection_is_a_connect_failure() -> None:
    async with serving(lambda r, w, n: answer(w)) as (url, _):
        pass  # closed: nothing listens on that port now
    async with Http11ReplicaClient(connect=1.0) as client:
        with pytest.raises(LocalOriginError, match="cannot reach replica") as caught:
            await fetch(client, url)
        assert caught.value.outcome is Outcome.CONNECT_FAILURE


@pytest.mark.asyncio
async def test_an_answer_cut_short_fails_mid_stream() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n > 1:
            await answer(writer, LENGTH_ANSWER + b'{"ok":true}')
            return
        await answer(
            writer,
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\ndata: a\r\n",
            b"20\r\npartial",
        )
        writer.close()

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:
        got: list[bytes] = []

        async def read_all() -> None:
            async with client.send(request(url)) as response:
                assert response.status == 200
                async for chunk in response.chunks:
                    got.append(chunk)

        with pytest.raises(LocalOriginError, match="connection lost"):
            await read_all()
        assert b"".join(got).startswith(b"data: a")  # handed on before the break
        # the broken connection is not reused
        assert await fetch(client, url) == (200, [b'{"ok":true}'])
        assert server.connections == 2


@pytest.mark.asyncio
async def test_a_content_length_answer_cut_short_and_one_until_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await answer(writer, b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        else:  # neither length nor chunked: the body ends when the connection does
            await answer(writer, b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"close")
        writer.close()

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:
        with pytest.raises(LocalOriginError, match="connection lost"):
            await fetch(client, url)
        status, chunks = await fetch(client, url)
        assert (status, b"".join(chunks)) == (200, b"until close")
        assert server.connections == 2


@pytest.mark.asyncio
async def test_an_abandoned_answer_closes_its_connection() -> None:
    """A caller that stops reading (a first-byte timeout, a client gone) leaves a
    connection that is not reused."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await answer(writer, b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
            await asyncio.sleep(0.2)
            await answer(writer, b"cd")
        else:
            await answer(writer, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1.0) as client:

        async def read_slowly() -> None:
            async with asyncio.timeout(0.05), client.send(request(url)) as response:
                async for _ in response.chunks:
                    pass

        with pytest.raises(TimeoutError):
            await read_slowly()
        assert await fetch(client, url) == (200, [b"ok"])
        assert server.connections == 2


# -- relaying a chunked body (``UpstreamResponse.relay``) ------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def unframe(frames: bytes) -> list[bytes]:
    """The payloads of whole chunk frames; fails on a partial one."""
    payloads = []
    while frames:
        eol = frames.index(b"\r\n")
        size = int(frames[:eol], 16)
        assert frames[eol + 2 + size : eol + 4 + size] == b"\r\n"
        payloads.append(frames[eol + 2 : eol + 2 + size])
        frames = frames[eol + 4 + size :]
    return payloads


class Sink:
    """A recording ``FrameSink`` (the client side): every write must be whole frames."""

    def __init__(self, keeps_up: bool = True) -> None:
        self.writes: list[bytes] = []
        self.keeps_up = keeps_up
        self.drained: Callable[[], None] | None = None

    def write_frames(self, frames: bytes) -> bool:
        unframe(frames)
        self.writes.append(frames)
        return self.keeps_up

    def on_drained(self, callback: Callable[[], None] | None) -> None:
        self.drained = callback

    def payloads(self) -> list[bytes]:
        return [p for w in self.writes for p in unframe(w)]


@pytest.mark.asyncio
async def test_a_relay_passes_whole_frames_split_anywhere_and_keeps_the_connection() -> None:
    events = [b"data: %d\n\n" % i for i in range(6)]
    wire = b"".join(frame(e) for e in events[1:]) + b"0\r\nx-trailer: 1\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:  # the first frame, then the rest cut at odd places
            await answer(writer, SSE_HEAD + frame(events[0])[:5], frame(events[0])[5:], gap=0.01)
            await answer(writer, *(wire[i : i + 7] for i in range(0, len(wire), 7)), gap=0.002)
        else:
            await answer(writer, LENGTH_ANSWER + b'{"ok":true}')

    async with serving(handler) as (url, server), Http11ReplicaClient(connect=1) as client:
        sink = Sink()
        async with client.send(request(url)) as response:
            first = await anext(response.chunks)
            assert response.relay is not None
            await response.relay(sink, 5.0)
        assert b"".join([first, *sink.payloads()]) == b"".join(events)
        assert await fetch(client, url) == (200, [b'{"ok":true}'])
        assert server.connections == 1


@pytest.mark.asyncio
async def test_a_relay_cut_mid_frame_fails_after_the_whole_frames() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(writer, SSE_HEAD + frame(b"data: a\n\n"), gap=0.01)
        await answer(writer, frame(b"data: b\n\n") + frame(b"data: c\n\n")[:6])
        writer.close()

    async with serving(handler) as (url, _), Http11ReplicaClient(connect=1) as client:
        sink = Sink()
        async with client.send(request(url)) as response:
            await anext(response.chunks)
            assert response.relay is not None
            with pytest.raises(LocalOriginError, match="connection lost"):
                await response.relay(sink, 5.0)
        assert sink.payloads() == [b"data: b\n\n"]


@pytest.mark.asyncio
async def test_a_silent_relay_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(writer, SSE_HEAD + frame(b"data: a\n\n"))
        await asyncio.sleep(5)

    async with (
        serving(handler) as (url, _),
        Http11ReplicaClient(connect=1) as client,
        client.send(request(url)) as response,
    ):
        await anext(response.chunks)
        assert response.relay is not None
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await response.relay(Sink(), 0.2)
        assert 0.2 <= asyncio.get_running_loop().time() - started < 1.0


@pytest.mark.asyncio
async def test_a_relay_stops_reading_while_the_client_lags() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await answer(writer, SSE_HEAD + frame(b"data: a\n\n"), gap=0.01)
        await answer(writer, *(frame(b"data: %d\n\n" % i) for i in range(3)), gap=0.01)
        await answer(writer, b"0\r\n\r\n")

    async with serving(handler) as (url, _), Http11ReplicaClient(connect=1) as client:
        sink = Sink(keeps_up=False)
        async with client.send(request(url)) as response:
            await anext(response.chunks)
            assert response.relay is not None
            relay = asyncio.ensure_future(response.relay(sink, 5.0))
            await asyncio.sleep(0.2)
            assert sink.payloads() == [b"data: 0\n\n"]  # paused after the first write
            assert sink.drained is not None
            sink.keeps_up = True
            sink.drained()
            await relay
        assert sink.payloads() == [b"data: %d\n\n" % i for i in range(3)]
