"""The gateway's KV-event decoder: every payload shape vLLM has published."""

from __future__ import annotations

import msgpack
import pytest

from gpufleet.fleet import KvBatch, KvCleared, KvRemoved, KvStored
from gpufleet.gateway._kv_events import KvDecodeError, decode_batch

BIG = (1 << 64) - 5


def test_map_events_in_an_array_batch_as_vllm_0_26_sends_them() -> None:
    payload = msgpack.packb(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [BIG, 7],
                    "parent_block_hash": None,
                    "token_ids": list(range(32)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                    "a_field_from_the_future": 1,
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNew", "block_hashes": [1]},
            ],
            0,
        ]
    )
    assert decode_batch(9, payload) == KvBatch(
        9, (KvStored((BIG, 7)), KvRemoved((7,)), KvCleared())
    )


def test_legacy_array_events_bytes_hashes_and_a_map_batch() -> None:
    digest = bytes(range(32))  # vLLM's bytes form: its low 8 bytes, big-endian, as the int
    low = int.from_bytes(digest[-8:], "big")
    legacy = [
        2.0,
        [
            ["BlockStored", [digest], None, list(range(16)), 16, None],
            ["BlockStored", [5], None, list(range(16)), 16, None, "CPU"],  # offloaded: skipped
            ["BlockRemoved", [digest], "GPU"],
            ["AllBlocksCleared"],
        ],
    ]
    assert decode_batch(0, msgpack.packb(legacy)) == KvBatch(
        0, (KvStored((low,)), KvRemoved((low,)), KvCleared())
    )
    as_map = {"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [3]}]}
    assert decode_batch(1, msgpack.packb(as_map)) == KvBatch(1, (KvRemoved((3,)),))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"ts": 1.0}),
        msgpack.packb([1.0, [["BlockStored", "not a list"]]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgpack.packb([1.0, [42]]),
    ],
)
def test_what_is_not_a_batch_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KvDecodeError):
        decode_batch(0, payload)
