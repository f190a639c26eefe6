"""Prompt token ids for trace requests: equal prefix blocks get equal ids, nothing else does.

Traces give lengths, not text, but the replica model's prefix cache works on token ids.
``PromptBuilder`` makes ids deterministically from what a trace does say::

    Mooncake request, input_length 1100, hash_ids [7, 9, 4], 512-token blocks

    ids   [ block(7): 512 ids ][ block(9): 512 ids ][ block(4)[:76] ]
           └── same ids in every request whose hash_ids start 7, 9 ...

    a request without hash_ids, trace index 42, 700 tokens

    ids   [ own(42): 700 ids ]           shares nothing with any other request

Each block (and each request's own ids) opens with a four-token header, a namespace token
(block or request) and the id in three base-``vocab`` digits, then continues with a window
of one seeded pseudo-random sequence. The model names a 16-token KV block by a hash chained
over the whole prefix, so a distinct header in the first 16 tokens is enough to make two
prompts share nothing from there on, and equal hash ids give equal ids, hence equal KV
blocks. A prompt longer than its hash blocks continues with ids of its own; hash ids beyond
the prompt's length are ignored (the last block is usually partial). A block is
``request.block_tokens`` long: 512 for Mooncake's ids, 128 for a recording's (the gateway's
512-character blocks); a block id is only ever used at one size within one trace.
"""

from __future__ import annotations

import random

from gpufleet.sim._traces import TraceRequest

_POOL_SIZE = 1 << 16
_HEADER = 4
_BLOCK_SPACE = 1
_REQUEST_SPACE = 2


class PromptBuilder:
    """Token ids for trace requests, for a model with ``vocab_size`` ids."""

    __slots__ = ("_limit", "_pool", "_vocab")

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be at least 3, got {vocab_size}")
        rng = random.Random(f"gpufleet/sim/prompts/{seed}")
        pool = [rng.randrange(vocab_size) for _ in range(_POOL_SIZE)]
        self._pool = tuple(pool + pool)  # doubled: any window up to _POOL_SIZE is one slice
        self._vocab = vocab_size
        self._limit = vocab_size**3

    def prompt(self, index: int, request: TraceRequest) -> tuple[int, ...]:
        """The prompt of trace request ``index`` (its position in the trace)."""
        length = request.input_tokens
        hashes = request.hash_ids
        if not hashes:
            return self._ids(_REQUEST_SPACE, index, length)
        ids: list[int] = []
        left = length
        for hash_id in hashes:
            if left <= 0:
                break
            take = min(left, request.block_tokens)
            ids.extend(self._ids(_BLOCK_SPACE, hash_id, take))
            left -= take
        if left > 0:
            ids.extend(self._ids(_REQUEST_SPACE, index, left))
        return tuple(ids)

    def _ids(self, space: int, name: int, length: int) -> tuple[int, ...]:
        """``length`` ids: the header of (space, name), then a window of the pool."""
        if not 0 <= name < self._limit:
            raise ValueError(f"id {name} is out of range for prompt headers (0 .. vocab³ - 1)")
        vocab = self._vocab
        header = (space, name % vocab, name // vocab % vocab, name // (vocab * vocab))
        if length <= _HEADER:
            return header[:length]
        offset = (name * 40_503 + space * 7_919) % _POOL_SIZE
        body = length - _HEADER
        if body <= _POOL_SIZE:
            return header + self._pool[offset : offset + body]
        ids = list(header)
        while body > 0:
            take = min(body, _POOL_SIZE)
            ids.extend(self._pool[offset : offset + take])
            body -= take
        return tuple(ids)
