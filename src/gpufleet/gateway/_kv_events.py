"""The gateway's side of the engines' KV events: subscribe, decode, hand to the controller.

::

    engine PUB ──[topic, seq, payload]──► SUB (one task per replica process) ──► decode_batch
        ──► KvEvents(model, replica, incarnation = its address, batches)  ──► the controller
    controller ──► KvResync(replica, from_seq) ──► DEALER to the engine's replay socket:
        [b"", from_seq] ──► [b"", seq, payload] … [b"", -1, b""] ──► KvEvents(replay=True)

A replica's engine advertises its two endpoints through the runtime (``Upstream.kv_events``,
``Upstream.kv_replay``; docs/kv-events.md). The subscription belongs to one process: its
address is the incarnation the controller checks, so a batch of an old process never lands
on a new one. Every rule (sequence gaps, restarts, staleness, what to match) is the
controller's; this module only moves bytes. A replay that does not answer within
``replay_timeout`` (or a replica with no replay socket) is reported as an empty replay, and
the index goes on from the batches it has.

:func:`decode_batch` reads what vLLM has published over its versions: a batch as an array
``[ts, events, dp_rank?]`` (or a map with ``events``), each event a map tagged by ``type``
(vLLM ≥ 0.26) or an array tagged by its first element (before); hashes as unsigned 64-bit
integers (vLLM's default) or as digest bytes (their low 8 bytes, as vLLM's integer form).
Events of another medium than the GPU (an offloading tier's) and unknown event types are
skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from gpufleet.control import Command, Event, KvEvents, KvResync
from gpufleet.fleet import KvBatch, KvCleared, KvEvent, KvRemoved, KvStored, ReplicaId
from gpufleet.gateway._replicas import Upstream

logger = logging.getLogger("gpufleet.gateway")

_LOW64: Final = (1 << 64) - 1
_GPU: Final = frozenset({None, "GPU", "gpu"})
_COALESCE: Final = 64
"""Batches already received that one KvEvents carries at most."""


class KvDecodeError(ValueError):
    """A payload that is not a KV-event batch."""


def _hash(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW64
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _LOW64
    raise KvDecodeError(f"a block hash must be an integer or bytes, got {value!r}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvDecodeError(f"block_hashes must be a list, got {value!r}")
    return tuple(_hash(h) for h in value)


def _event(raw: object) -> KvEvent | None:
    """One event (``None``: one to skip)."""
    if isinstance(raw, dict):
        kind, hashes, medium = raw.get("type"), raw.get("block_hashes"), raw.get("medium")
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        hashes = raw[1] if len(raw) > 1 else None
        at = 6 if kind == "BlockStored" else 2  # the positional medium, when present
        medium = raw[at] if len(raw) > at else None
    else:
        raise KvDecodeError(f"not a KV event: {raw!r}")
    if medium not in _GPU:
        return None
    if kind == "BlockStored":
        return KvStored(_hashes(hashes))
    if kind == "BlockRemoved":
        return KvRemoved(_hashes(hashes))
    if kind == "AllBlocksCleared":
        return KvCleared()
    return None


def decode_batch(seq: int, payload: bytes) -> KvBatch:
    """A published batch's payload as the controller's :class:`KvBatch`."""
    try:
        data: Any = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack raises several types for bad bytes
        raise KvDecodeError(f"not msgpack: {error}") from None
    events = data.get("events") if isinstance(data, dict) else None
    if isinstance(data, list) and len(data) >= 2:
        events = data[1]
    if not isinstance(events, list):
        raise KvDecodeError(f"not a KV event batch: {data!r}")
    decoded = (_event(e) for e in events)
    return KvBatch(seq, tuple(e for e in decoded if e is not None))


def _frames(frames: list[bytes]) -> KvBatch | None:
    """``[topic, seq, payload]`` from the PUB socket, decoded (``None``: undecodable)."""
    if len(frames) != 3:
        logger.warning("a KV-event message of %d frames ignored", len(frames))
        return None
    try:
        return decode_batch(int.from_bytes(frames[1], "big"), frames[2])
    except KvDecodeError as error:
        logger.warning("a KV-event batch was not decoded: %s", error)
        return None


def _process(upstream: Upstream) -> tuple[str | None, str | None, str | None]:
    """What names an engine process's feed: its address and its two endpoints."""
    return upstream.url, upstream.kv_events, upstream.kv_replay


class KvFeeds:
    """One SUB task per replica process that advertises KV events, in the app's task group.

    ``handle`` is the shell's way into the controller (``LiveControl.handle``).
    """

    def __init__(
        self, handle: Callable[[Event], list[Command]], *, replay_timeout: float = 2.0
    ) -> None:
        self._handle = handle
        self.replay_timeout = replay_timeout
        self._context: zmq.asyncio.Context | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._wanted: dict[ReplicaId, tuple[str, Upstream]] = {}
        """By name: the pool and the upstream to subscribe to."""
        self._running: dict[ReplicaId, tuple[Upstream, asyncio.Task[None]]] = {}
        self.batches = 0
        """Batches received live (for tests and the console)."""
        self.replays = 0

    def start(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks
        self._sync()

    def stop(self) -> None:
        for _, task in self._running.values():
            task.cancel()
        self._running.clear()
        self._tasks = None
        if self._context is not None:
            # close what the cancelled tasks have not closed yet (term() alone would wait
            # for them: a cancelled task's ``finally`` runs only after this returns)
            self._context.destroy(linger=0)
            self._context = None

    def update(self, upstreams: Mapping[ReplicaId, tuple[str, Upstream]]) -> None:
        """The replicas to subscribe to now: ``(pool, upstream)`` by name (each with its
        ``kv_events`` endpoint); a changed process is subscribed to afresh."""
        self._wanted = dict(upstreams)
        self._sync()

    def _sync(self) -> None:
        tasks = self._tasks
        if tasks is None:
            return
        for name in list(self._running):
            upstream, task = self._running[name]
            wanted = self._wanted.get(name)
            if wanted is None or _process(wanted[1]) != _process(upstream):
                task.cancel()  # gone, or another process (a state change is not)
                del self._running[name]
        for name, (model, upstream) in self._wanted.items():
            if name not in self._running and upstream.kv_events is not None:
                task = tasks.create_task(self._subscribe(model, upstream), name=f"kv-{name}")
                self._running[name] = (upstream, task)

    def _zmq(self) -> zmq.asyncio.Context:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        return self._context

    async def _subscribe(self, model: str, upstream: Upstream) -> None:
        assert upstream.kv_events is not None
        sock = self._zmq().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(upstream.kv_events)
        try:
            while True:
                received = [_frames(await sock.recv_multipart())]
                while len(received) < _COALESCE:  # what already waits goes in one event
                    try:
                        received.append(_frames(await sock.recv_multipart(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                batches = tuple(b for b in received if b is not None)
                self.batches += len(batches)
                if batches:
                    self._handle(KvEvents(model, upstream.name, upstream.url, batches))
        finally:
            sock.close(0)

    def resync(self, command: KvResync, upstream: Upstream | None) -> None:
        """Carry out a :class:`KvResync`: ask the replica's replay socket, report back."""
        tasks = self._tasks
        if tasks is None or upstream is None:
            return
        tasks.create_task(self._replay(command, upstream), name=f"kv-replay-{upstream.name}")

    async def _replay(self, command: KvResync, upstream: Upstream) -> None:
        self.replays += 1
        batches: list[KvBatch] = []
        if upstream.kv_replay is not None:
            sock = self._zmq().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(upstream.kv_replay)
            try:
                await sock.send_multipart((b"", command.from_seq.to_bytes(8, "big")))
                async with asyncio.timeout(self.replay_timeout):
                    while True:
                        frames = await sock.recv_multipart()
                        seq = int.from_bytes(frames[-2], "big", signed=True)
                        if seq < 0:
                            break
                        try:
                            batches.append(decode_batch(seq, frames[-1]))
                        except KvDecodeError as error:
                            logger.warning("a replayed KV-event batch was not decoded: %s", error)
            except TimeoutError:
                logger.warning(
                    "%s: its KV-event replay did not end within %g s",
                    upstream.name,
                    self.replay_timeout,
                )
            finally:
                sock.close(0)
        if self._tasks is not None:
            replayed = KvEvents(command.model, upstream.name, upstream.url, tuple(batches), True)
            self._handle(replayed)
