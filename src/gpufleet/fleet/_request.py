"""What routing knows about a request, and how it ended.

The gateway does not tokenize, so a request names its prompt by *prefix hashes*: the prompt
text cut into blocks of ``block_chars`` characters, each block's hash chained over all the
blocks before it, so one hash names a whole prefix::

    text     [   block 0   ][   block 1   ][   block 2   ][ tail ]   (tail: not hashed)
    hashes    h0 = H(∅, b0)  h1 = H(h0, b1)  h2 = H(h1, b2)

Two prompts that share their first ``k`` blocks share ``h0 … h(k-1)`` and nothing after, as
the engines' prefix caches do with token blocks. A simulator replaying a trace that carries
block ids (Mooncake's ``hash_ids``) passes those ids as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final


@dataclass(slots=True)  # made per request: not frozen (cheaper); never changed
class RouteRequest:
    """A request as the router sees it; the gateway fills it from the body and headers."""

    request_id: str
    model: str
    prefix_hashes: tuple[int, ...] = ()
    """Chained prefix-block hashes of the prompt (:func:`text_prefix_hashes`)."""
    prompt_tokens: int = 0
    """Estimated prompt length in tokens (the gateway's cheap estimate)."""
    session_key: str | None = None
    """Affinity key: a session header, or the OpenAI ``user`` field."""
    tenant: str | None = None
    max_tokens: int | None = None
    """The most output tokens it asks for (``max_tokens``/``max_completion_tokens``; ``None``:
    not said). With ``prompt_tokens``, what a pool's context must hold."""
    block_hashes: tuple[int, ...] = ()
    """The engine's own block hashes of the prompt (its tokens, its block size, chained and
    seeded as the engine does; 64-bit integers as its KV events carry them), when the shell
    can compute them: what a router indexing KV events matches (docs/kv-events.md)."""
    adapter: str | None = None
    """The LoRA adapter it asks for (its served name), when ``model`` is the adapter's base
    pool: the controller places it on a replica that holds the adapter, or loads it."""


def text_prefix_hashes(text: str, block_chars: int = 512, max_blocks: int = 256) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full ``block_chars``-character blocks.

    Uses Python's ``hash``, which is salted per process: the hashes name prefixes within one
    gateway process, which is all a router's index needs (equal prompts, equal hashes), and
    they cost about 20 µs for a 32 kB prompt. They are not stable across processes.
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be at least 1, got {block_chars}")
    end = min(len(text) // block_chars, max_blocks) * block_chars
    hashes: list[int] = []
    chained = 0
    for start in range(0, end, block_chars):
        chained = hash((chained, text[start : start + block_chars]))
        hashes.append(chained)
    return tuple(hashes)


class Outcome(StrEnum):
    """How a request sent to a replica ended, as outlier detection classifies it.

    Failures are *local-origin* (the gateway could not reach the replica or gave up
    waiting) or *replica-origin* (the replica answered with a server error), after Envoy.
    """

    SUCCESS = "success"
    """A response (2xx), streamed to the end."""
    CLIENT_ERROR = "client_error"
    """A 4xx: the replica worked; the request was bad."""
    CANCELLED = "cancelled"
    """The client went away; says nothing about the replica."""
    REPLICA_ERROR = "replica_error"
    """A 5xx from the replica (replica-origin)."""
    CONNECT_FAILURE = "connect_failure"
    """Connection refused or reset before a response (local-origin)."""
    TIMEOUT = "timeout"
    """Connect, first-byte or idle-stream timeout (local-origin)."""


LOCAL_ORIGIN_FAILURES: Final = frozenset({Outcome.CONNECT_FAILURE, Outcome.TIMEOUT})
REPLICA_ORIGIN_FAILURES: Final = frozenset({Outcome.REPLICA_ERROR})
FAILURES: Final = LOCAL_ORIGIN_FAILURES | REPLICA_ORIGIN_FAILURES
"""Outcomes that count against a replica's health."""
