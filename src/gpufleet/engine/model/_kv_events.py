"""What the prefix cache tells the world: vLLM-shaped KV events, and the hashes to match them.

With ``ReplicaConfig(kv_events=True)`` the KV cache manager keeps a list of what its prefix
cache did, in order, which the shell drains with ``ReplicaModel.take_kv_events()`` after each
step and publishes (the sim engine: over ZMQ, as vLLM does; the fleet simulator: straight to
the controller)::

    allocate → take() evicts b7 (held h2)      BlockRemoved([h2])
    register blocks 4..6 of a request          BlockStored([h4, h5, h6], parent=h3, tokens)

A stored run is cut where a block's contents were already cached by another block (the
pool names one block per hash: the copy stays anonymous and is never announced), so a
``BlockStored`` always names hashes new to the cache, and a ``BlockRemoved`` the hashes the
cache no longer holds. Nothing is recorded with ``kv_events`` off: the simulator's hot path
pays one ``is None`` test per allocation.

Outside the engine, a block hash travels as an unsigned 64-bit integer (vLLM's default
integer form of its digests: the low 8 bytes, big-endian, :func:`external_hash`). A router
computes a prompt's hashes the same way (``block_hash_chain`` in ``_kv_cache``): same
tokens, same block size, same root, so equal prefixes give equal integers in the gateway
and in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

_LOW64 = (1 << 64) - 1


def external_hash(block_hash: bytes) -> int:
    """A block hash as an engine's events carry it: its low 64 bits, read big-endian."""
    return int.from_bytes(block_hash, "big") & _LOW64


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, in chain order; ``parent`` is the hash before the first
    (``None``: the first is a prompt's first block); ``token_ids`` are theirs, in order."""

    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped."""


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
