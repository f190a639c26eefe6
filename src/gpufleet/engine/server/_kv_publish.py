"""The sim engine's KV-event publisher: vLLM's ``--kv-events-config``, on the same wire.

::

    gpufleet engine sim --kv-events-config '{"enable_kv_cache_events": true,
        "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'

After each step the engine loop drains the replica model's KV events (``take_kv_events``)
and, when there are any, publishes them as one batch (docs/kv-events.md has the format)::

    PUB     [topic, seq: 8 bytes big-endian, payload: msgpack [ts, [event, …], dp_rank]]
    ROUTER  ← [client id, b"", start seq: 8 bytes big-endian]
            → [client id, b"", seq, payload] for each buffered batch from start on, then
              [client id, b"", -1 (8 bytes, signed), b""]

An event is a msgpack map tagged by ``type`` (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), block hashes are unsigned 64-bit integers. The last ``buffer_steps``
batches are kept for replay. Unlike vLLM, which binds an endpoint with a ``*`` and connects
to any other, the sim engine always binds (it is the stable end), and a port of 0 takes any
free one (:attr:`KvEventPublisher.endpoint` names what was bound).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from gpufleet.engine.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    external_hash,
)
from gpufleet.engine.server._config import KvEventsConfig

logger = logging.getLogger("gpufleet.engine")

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last frame's seq: nothing more follows."""
MEDIUM: Final = "GPU"


def event_map(event: KvCacheEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec encoding writes it (a map tagged by ``type``)."""
    if isinstance(event, BlockStored):
        hashes = [external_hash(h) for h in event.block_hashes]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None if event.parent is None else external_hash(event.parent),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "extra_keys": [None] * len(hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "medium": MEDIUM,
            "group_idx": 0,
        }
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[KvCacheEvent], ts: float, dp_rank: int = 0) -> bytes:
    """A batch's payload: ``[ts, [event, …], dp_rank]`` in msgpack."""
    packed: bytes = msgpack.packb([ts, [event_map(e) for e in events], dp_rank])
    return packed


class KvEventPublisher:
    """A PUB socket for batches, a ROUTER socket that replays the buffered ones."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._async = zmq.asyncio.Context()
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._async.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.published = 0
        self.dropped = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KvCacheEvent]) -> None:
        """Send one batch (dropped, but still buffered for replay, past the high-water mark)."""
        seq = self._seq
        self._seq += 1
        payload = encode_batch(events, time.time())
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (nothing to do without a replay socket)."""
        sock = self._replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                logger.warning("a KV-event replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._context.term()
        self._async.term()
