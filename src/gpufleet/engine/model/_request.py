"""A request inside the replica: its tokens, how far its KV cache has caught up, its status."""

from __future__ import annotations

from enum import Enum

from gpufleet.engine.model._tokens import FillerTokens, pack_tokens
from gpufleet.engine.model._types import NewRequest


class RequestStatus(Enum):
    WAITING = "waiting"
    """In the waiting queue: new, or preempted (then ``num_preemptions > 0``)."""
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Mutable state of one request. Tokens are the prompt followed by the generated tokens::

        token index   0 ...................... P-1 | P ............. T-1
                      prompt (P tokens)            | output (T-P so far)
                      |<---- computed (in KV) ---->|<-- not yet -->|

    ``num_computed_tokens`` catches up with ``num_tokens``; a step that makes them equal
    samples one more token, so ``num_tokens`` grows by one. Preemption resets
    ``num_computed_tokens`` to 0 and keeps the output, which is then recomputed with the prompt.

    Output token ``i`` is ``filler.token(output_offset + i)``: deterministic, never stored.
    """

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "kv_checkpoint",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens",
        "output_offset",
        "pooling",
        "priority",
        "prompt_bytes",
        "request_id",
        "seq",
        "status",
        "target_output_tokens",
    )

    def __init__(
        self,
        new: NewRequest,
        *,
        arrival_time: float,
        seq: int,
        target_output_tokens: int,
        output_offset: int,
    ) -> None:
        self.request_id = new.request_id
        self.prompt_bytes = pack_tokens(new.prompt_token_ids)
        self.num_prompt_tokens = len(new.prompt_token_ids)
        self.pooling = new.pooling
        """Prompt-only: finishes when its prompt is computed, with no output token."""
        self.max_tokens = 0 if new.pooling else new.max_tokens
        self.priority = new.priority
        self.arrival_time = arrival_time
        self.seq = seq
        """Arrival order in the replica: breaks ties deterministically."""
        self.target_output_tokens = target_output_tokens
        """Generation stops here: ``max_tokens`` (finish reason length) or earlier (stop)."""
        self.output_offset = output_offset
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        """Chained hashes of this request's full blocks, computed as far as needed."""
        self.kv_checkpoint = 1
        """The KV manager must see this request before its computed tokens reach this."""

    def token_bytes(self, start: int, end: int, filler: FillerTokens) -> bytes:
        """Tokens ``[start, end)`` packed as ``pack_tokens`` does."""
        prompt = self.num_prompt_tokens
        if end <= prompt:
            return self.prompt_bytes[4 * start : 4 * end]
        if start >= prompt:
            return filler.span_bytes(self.output_offset + start - prompt, end - start)
        return self.prompt_bytes[4 * start :] + filler.span_bytes(self.output_offset, end - prompt)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"output={self.num_output_tokens}/{self.target_output_tokens})"
        )
