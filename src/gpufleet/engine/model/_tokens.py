"""Generated tokens: how many a request produces and which ids, deterministically.

Nothing here depends on arrival order or on the other requests: each request draws from its
own ``random.Random`` seeded by ``(config seed, request id)``, so a request produces the same
tokens whichever replica, batch or step it runs in.

Token ids are read from one fixed pseudo-random sequence per replica seed (the *filler*),
starting at a per-request offset::

    filler  (size S, repeated)   ...  f[o]  f[o+1]  f[o+2] ...
    output token i of a request  =    f[(o + i) mod S]          o = the request's offset

so producing a token is one list index, and the bytes of a run of output tokens (which block
hashes need) are one slice of the packed filler.
"""

from __future__ import annotations

import math
import random
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

FILLER_SIZE = 1 << 14
MIN_RUN = 8
"""Tokens of a filler run a context must end with to be continued (``position_after``):
a chance match of 8 random ids (or of 8 words of 242) is vanishingly rare."""
# Token ids are hashed as 4-byte little-endian words, the same on every machine.
_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian words (what block hashes are computed over)."""
    words = array(_TYPECODE, token_ids)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI machine
        words.byteswap()
    return words.tobytes()


def unpack_tokens(packed: bytes) -> tuple[int, ...]:
    """The inverse of :func:`pack_tokens`."""
    words = array(_TYPECODE)
    words.frombytes(packed)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI machine
        words.byteswap()
    return tuple(words)


class FillerTokens:
    """The token-id sequence every generated text of one replica is a window of."""

    __slots__ = ("_at", "_packed", "ids", "mask")

    def __init__(self, seed: int, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        rng = random.Random(f"gpufleet/filler/{seed}")
        self.ids: list[int] = [rng.randrange(vocab_size) for _ in range(FILLER_SIZE)]
        self.mask = FILLER_SIZE - 1
        self._packed = pack_tokens(self.ids + self.ids)  # doubled: a span up to S is one slice
        self._at: dict[int | None, dict[int, list[int]]] = {}
        """Positions of each id (or id mod ``modulus``), built on first use."""

    def position_after(
        self, tail: Sequence[int], *, modulus: int | None = None, min_run: int = MIN_RUN
    ) -> int | None:
        """Where the filler goes on after a context that ends in a run of it: the position
        after the longest run of filler tokens that ``tail`` ends with (at least
        ``min_run``; ties: the lowest position), else ``None``. With ``modulus``, tokens
        are compared modulo it (generated text read back as words: ``id % len(WORDS)``).

        This is what makes a continuation deterministic, as a greedy decoder's is: a prompt
        that ends with the first ``k`` tokens a request generated goes on with its ``k+1``-th::

            filler   … f[p-2] f[p-1] f[p] │ f[p+1] …
            tail       …  t[-3]  t[-2]  t[-1]  ─► p + 1
        """
        if len(tail) < min_run:
            return None
        index = self._at.get(modulus)
        if index is None:
            index = self._at[modulus] = {}
            for position, token in enumerate(self.ids):
                key = token if modulus is None else token % modulus
                index.setdefault(key, []).append(position)
        mask, ids = self.mask, self.ids
        best, best_run = None, min_run - 1
        for end in index.get(tail[-1], ()):
            run = 1
            limit = min(len(tail), FILLER_SIZE)
            while run < limit:
                token = ids[(end - run) & mask]
                if (token if modulus is None else token % modulus) != tail[-1 - run]:
                    break
                run += 1
            if run > best_run:
                best, best_run = end, run
        return None if best is None else best + 1

    def token(self, position: int) -> int:
        return self.ids[position & self.mask]

    def span_bytes(self, position: int, count: int) -> bytes:
        """Tokens ``position .. position + count - 1`` as 4-byte little-endian words."""
        if count <= FILLER_SIZE:  # one slice of the doubled sequence
            start = 4 * (position & self.mask)
            return self._packed[start : start + 4 * count]
        parts: list[bytes] = []
        while count > 0:
            start = position & self.mask
            take = min(count, FILLER_SIZE)
            parts.append(self._packed[4 * start : 4 * (start + take)])
            position += take
            count -= take
        return b"".join(parts)


@lru_cache(maxsize=16)
def shared_filler(seed: int, vocab_size: int) -> FillerTokens:
    """The filler of ``(seed, vocab_size)``, made once per process: replicas of one config
    share it (it is never changed; ~0.7 MB each, which a 1,000-replica fleet felt)."""
    return FillerTokens(seed, vocab_size)


@dataclass(frozen=True, slots=True)
class OutputDraw:
    target_output_tokens: int
    output_offset: int


class OutputLengths:
    """Draws each request's output length: log-normal, bounded by ``max_tokens``."""

    __slots__ = ("_mu", "_seed", "_sigma")

    def __init__(self, seed: int, median: float, sigma: float) -> None:
        self._seed = seed
        self._mu = math.log(median)
        self._sigma = sigma

    def draw(self, request_id: str, max_tokens: int, *, ignore_eos: bool) -> OutputDraw:
        rng = random.Random(f"gpufleet/request/{self._seed}/{request_id}")
        offset = rng.randrange(FILLER_SIZE)  # drawn first: ignore_eos does not change the text
        if ignore_eos:
            return OutputDraw(max_tokens, offset)
        length = rng.lognormvariate(self._mu, self._sigma)
        target = max_tokens if length >= max_tokens else max(1, round(length))
        return OutputDraw(target, offset)
