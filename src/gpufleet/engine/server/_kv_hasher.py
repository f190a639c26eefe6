"""A request body's engine block hashes, computed as a sim engine would: for the gateway.

A router that matches KV events needs the prompt's blocks named as the engine names them:
the same tokenizer and chat template, the same block size, the same hash chain and root::

    hasher = SimBlockHasher(config)                  # the pool's SimEngineConfig
    hasher({"messages": [{"role": "user", "content": "Hi"}], ...})   # → (h0, h1, …)

The gateway imports no engine code; ``gpufleet up`` hands it this callable per pool
(``create_gateway(kv_hasher=...)``). A body the engine would refuse hashes to ``()``: the
request then routes as if it had no prompt blocks, and the engine answers the error.
"""

from __future__ import annotations

from typing import Any

import pydantic

from gpufleet.engine._tokenizer import Tokenizer
from gpufleet.engine.model import block_hash_chain
from gpufleet.engine.server._config import SimEngineConfig
from gpufleet.engine.server._errors import ApiError
from gpufleet.engine.server._protocol import ChatRequest
from gpufleet.engine.server._tokenize import chat_prompt_ids

MAX_BLOCKS = 16384
"""The most leading blocks hashed (256k tokens at 16 a block): the index cannot use more."""


class SimBlockHasher:
    """``(body) -> block hashes`` for the engines of one sim engine config."""

    def __init__(self, config: SimEngineConfig, max_blocks: int = MAX_BLOCKS) -> None:
        spec = config.replica_config().model
        self.tokenizer = Tokenizer(spec.vocab_size)
        self.block_size = config.block_size
        self.max_blocks = max_blocks

    def prompt_ids(self, body: dict[str, Any]) -> tuple[int, ...]:
        """The prompt's token ids as the engine's routes compute them (``()``: none)."""
        try:
            if "messages" in body:
                return tuple(chat_prompt_ids(self.tokenizer, ChatRequest.model_validate(body)))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return tuple(prompt)
        except (pydantic.ValidationError, ApiError, ValueError):
            pass
        return ()

    def __call__(self, body: dict[str, Any]) -> tuple[int, ...]:
        ids = self.prompt_ids(body)
        return block_hash_chain(ids, self.block_size, self.max_blocks) if ids else ()
