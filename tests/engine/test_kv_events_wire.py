"""The sim engine's KV events on the wire: vLLM's framing, msgpack shape and replay socket
(a real engine under uvicorn, a real ZMQ subscriber over loopback)."""

from __future__ import annotations

import time

import httpx
import msgpack
import zmq

from gpufleet.engine.model import external_hash
from gpufleet.engine.server import SimBlockHasher, SimEngineConfig
from gpufleet.fleet import KvRemoved, KvStored
from gpufleet.gateway._kv_events import decode_batch
from tests.engine.conftest import FAST, serve

CONFIG = SimEngineConfig(
    time_scale=FAST,
    max_model_len=1024,
    num_gpu_blocks_override=64,  # 1,024 tokens: a few prompts evict each other
    kv_events={
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "topic": "kv",
    },
)


def _body(i: int, words: int) -> dict[str, object]:
    text = " ".join(f"w{i}x{k}" for k in range(words))
    return {"model": CONFIG.name, "prompt": text, "max_tokens": 2, "ignore_eos": True}


def _receive(sock: zmq.Socket[bytes], until: float) -> list[list[bytes]]:
    frames = []
    while sock.poll(int(max(0.0, until - time.monotonic()) * 1000)):
        frames.append(sock.recv_multipart())
    return frames


def test_batches_are_vllm_shaped_and_rebuild_the_cache_and_replay_answers() -> None:
    context = zmq.Context()
    with serve(CONFIG) as engine:
        publisher = engine.app.state.engine.kv_events
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        time.sleep(0.3)  # the slow joiner: let the subscription reach the publisher
        hasher = SimBlockHasher(CONFIG)
        bodies = [_body(i, 300) for i in range(6)]  # ~300 tokens each: 64 blocks overflow
        with httpx.Client(base_url=engine.url, timeout=30) as client:
            for body in bodies:
                assert client.post("/v1/completions", json=body).status_code == 200
        messages = _receive(sub, time.monotonic() + 1.0)
        assert messages
        topic, seq, payload = messages[0]
        assert topic == b"kv"
        assert len(seq) == 8
        raw = msgpack.unpackb(payload)
        assert isinstance(raw[0], float)
        assert raw[2] == 0  # data-parallel rank
        first = raw[1][0]
        assert first["type"] == "BlockStored"
        assert first["block_size"] == 16
        assert first["medium"] == "GPU"
        assert first["parent_block_hash"] is None
        assert len(first["token_ids"]) == 16 * len(first["block_hashes"])
        # sequence numbers count from 0 without a hole
        seqs = [int.from_bytes(m[1], "big") for m in messages]
        assert seqs == list(range(len(seqs)))
        batches = [decode_batch(s, m[2]) for s, m in zip(seqs, messages, strict=True)]
        held: set[int] = set()
        for batch in batches:
            for event in batch.events:
                if isinstance(event, KvStored):
                    held.update(event.hashes)
                elif isinstance(event, KvRemoved):
                    held.difference_update(event.hashes)
        removed = [e for b in batches for e in b.events if isinstance(e, KvRemoved)]
        assert removed  # the small cache evicted
        # the events leave the engine's own cache, and the gateway-side hashes name it
        cached = engine.app.state.engine.model._kv.pool._cached
        assert held == {external_hash(h) for h in cached}
        last = hasher(bodies[-1])  # BOS and 300 words: 301 tokens, 18 full blocks
        assert len(last) == 18
        assert set(last) <= held  # the last prompt is cached under the hashes we compute
        assert not set(hasher(bodies[0])) <= held  # the first was evicted
        # the replay socket answers from seq 2 on, then the end marker
        dealer = context.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = _receive(dealer, time.monotonic() + 1.0)
        assert [int.from_bytes(f[1], "big", signed=True) for f in replayed] == [*seqs[2:], -1]
        assert [f[2] for f in replayed[:-1]] == [m[2] for m in messages[2:]]
        assert replayed[-1][2] == b""
        sub.close(0)
        dealer.close(0)
    context.term()
