"""``POST /v1/embeddings``: vLLM's embeddings API over the modelled replica.

    client.embeddings.create(model="llama-3.1-8b", input=["a text", "another"], dimensions=256)

Each input is one *pooling* request in the replica model: scheduled, chunked and prefilled
like any prompt (it takes its share of the token budget and its KV blocks), and finished when
its prompt is computed, with no token generated. An embedding request therefore loads the
replica as a real one does, and counts in the metrics as vLLM counts pooling requests (prompt
tokens, a TTFT at the end of the prefill, an e2e latency, ``finished_reason="stop"``).

The vector is a deterministic function of the engine seed and the input's token ids, of the
model's hidden size: 32-bit words of SHAKE-256 over them, scaled to unit norm. ``dimensions``
keeps the first ``d`` words and normalizes again (Matryoshka style: a shorter embedding is a
prefix of the longer one, renormalized). Equal inputs give equal vectors; there is no
semantic similarity between different ones.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import struct
import sys
import time
from array import array
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.engine.model import NewRequest
from gpufleet.engine.server._asgi import (
    JSON_HEADERS,
    JsonRoute,
    Respond,
    Scope,
    Send,
    check_model,
    parse_body,
    send_bytes,
    send_error,
)
from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import ApiError, EngineUnavailableError, InvalidRequestError
from gpufleet.engine.server._loop import EngineDeadError, RequestStream

_INT32 = 2**31 - 1


class EmbeddingRequest(BaseModel):
    """vLLM's ``EmbeddingCompletionRequest`` (unknown fields are ignored, as vLLM does)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=-_INT32, le=_INT32)
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"


def embed(token_ids: tuple[int, ...], dimensions: int, seed: int) -> list[float]:
    """The unit vector of ``token_ids``: ``dimensions`` words of SHAKE-256, normalized."""
    key = struct.pack(f"<q{len(token_ids)}I", seed, *token_ids)
    words = array("i")
    words.frombytes(hashlib.shake_256(b"gpufleet-embedding/" + key).digest(4 * dimensions))
    if sys.byteorder == "big":  # pragma: no cover - no big-endian CI machine
        words.byteswap()
    norm = math.hypot(*words)
    return [w / norm for w in words] if norm else [1.0] + [0.0] * (dimensions - 1)


def encode_base64(vector: list[float], endianness: str) -> str:
    """float32 bytes, base64 (what the openai client decodes); native byte order by default."""
    data = array("f", vector)
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder:
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode()


class Embeddings(JsonRoute):
    """``POST /v1/embeddings``."""

    def accept(self, scope: Scope, payload: Any) -> Respond:
        request = parse_body(EmbeddingRequest, payload)
        engine = self.engine
        adapter = check_model(engine, request.model)
        size = engine.hidden_size
        if request.dimensions is not None and request.dimensions > size:
            raise InvalidRequestError(
                f"dimensions must be at most {size} (the model's embedding size), "
                f"got {request.dimensions}",
                param="dimensions",
            )
        prompts = self._prompts(request)
        return functools.partial(self._respond, scope, request, prompts, adapter)

    def _prompts(self, request: EmbeddingRequest) -> list[tuple[int, ...]]:
        tokenizer = self.engine.tokenizer
        items = _items(request.input)
        if not items:
            raise InvalidRequestError("input cannot be empty", param="input")
        prompts: list[tuple[int, ...]] = []
        for item in items:
            if isinstance(item, str):
                ids = tokenizer.encode(item, add_bos=request.add_special_tokens)
            else:
                ids = tuple(item)
                bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
                if bad:
                    raise InvalidRequestError(
                        f"Token id {bad[0]} is out of vocabulary", param="input"
                    )
            if not ids:
                raise InvalidRequestError("input cannot be empty", param="input")
            if len(ids) > self.engine.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.engine.max_model_len} "
                    f"tokens. However, you requested {len(ids)} tokens in the input for "
                    "embedding generation. Please reduce the length of the input.",
                    param="input",
                )
            prompts.append(ids)
        return prompts

    async def _respond(
        self,
        scope: Scope,
        request: EmbeddingRequest,
        prompts: list[tuple[int, ...]],
        adapter: str | None,
        send: Send,
    ) -> None:
        engine = self.engine
        news = [
            NewRequest(
                engine.new_request_id(), ids, max_tokens=1, priority=request.priority, pooling=True
            )
            for ids in prompts
        ]
        try:
            streams = await engine.submit_as(adapter, news)
        except ApiError as error:
            await send_error(send, error)
            return
        done = False
        try:
            try:
                for stream in streams:
                    await _pooled(stream)
                body = self._body(engine, scope, request, prompts, adapter or engine.name)
            except EngineDeadError as error:
                await send_error(send, EngineUnavailableError(str(error)))
            else:
                await send_bytes(send, 200, body, JSON_HEADERS)
            done = True
        except OSError:  # the connection broke while writing
            pass
        finally:
            if not done:
                for stream in streams:
                    engine.loop.abort(stream.request_id)
            engine.release_lora(streams)

    @staticmethod
    def _body(
        engine: SimEngine,
        scope: Scope,
        request: EmbeddingRequest,
        prompts: list[tuple[int, ...]],
        model: str,
    ) -> bytes:
        dimensions = request.dimensions or engine.hidden_size
        seed = engine.config.seed
        data: list[dict[str, Any]] = []
        for index, ids in enumerate(prompts):
            vector = embed(ids, dimensions, seed)
            encoded: list[float] | str = (
                vector
                if request.encoding_format == "float"
                else encode_base64(vector, request.endianness)
            )
            data.append({"index": index, "object": "embedding", "embedding": encoded})
        tokens = sum(len(ids) for ids in prompts)
        body = {
            "id": engine.response_id("embd", scope),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        return json.dumps(body, separators=(",", ":")).encode()


def _items(given: list[int] | list[list[int]] | str | list[str]) -> list[str | list[int]]:
    """The inputs of one request: a string or a token-id list is one input."""
    if isinstance(given, str):
        return [given]
    if given and isinstance(given[0], int):
        return [given]
    return list(cast("list[str] | list[list[int]]", given))


async def _pooled(stream: RequestStream) -> None:
    """Wait until a pooling request's one output arrives (``EngineDeadError`` if it cannot)."""
    while True:
        outputs = await stream.next()
        if any(output.finish_reason is not None for output in outputs):
            return
        if not outputs:
            raise EngineDeadError("the request ended before its prompt was computed")
