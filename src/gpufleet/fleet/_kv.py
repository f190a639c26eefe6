"""KV-cache events as the control plane reads them: which blocks an engine stored or dropped.

An engine that publishes KV events (vLLM's ``--kv-events-config``, the sim engine's flag of
the same name; docs/kv-events.md) sends numbered *batches*; each batch lists what its prefix
cache did since the last one::

    batch seq 41   [Stored(h7 h8 h9), Removed(h2)]      blocks h7..h9 now cached, h2 evicted
    batch seq 42   [Cleared()]                          the whole cache was reset

A block hash names a full block of ``block_size`` tokens *and* every token before it (the
hashes are chained), as an unsigned 64-bit integer: the wire's integer form of vLLM's
block hash (the low 8 bytes of the digest, big-endian). The shells decode the wire into
these values; the routers index them. Only the hashes travel further: the token ids and
the parent hash of a ``BlockStored`` stay in the shell.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvStored:
    """The engine cached these blocks (in chain order)."""

    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvRemoved:
    """The engine evicted these blocks."""

    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCleared:
    """The engine dropped every cached block."""


KvEvent = KvStored | KvRemoved | KvCleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One published batch: its sequence number (0, 1, 2 … per engine process) and events."""

    seq: int
    events: tuple[KvEvent, ...]
