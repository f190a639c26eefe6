"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``.

Served only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set (404 otherwise, as vLLM does not
mount them); without ``--enable-lora`` they answer 400. The answers are vLLM's::

    200  Success: LoRA adapter 'sql' added successfully.       text, no content type
    200  Success: LoRA adapter 'sql' removed successfully.
    400  InvalidUserInput   a name or path that is empty; a name already loaded (unless
                            "load_inplace": true, which loads it again)
    404  NotFoundError      unloading a name that is not loaded
    500  InternalServerError  "Call to add_lora method failed: LoRA rank 64 is greater than
                            max_lora_rank 16." (or an unreadable adapter_config.json)

A body that is not JSON, or lacks ``lora_name`` (or ``lora_path`` for a load), is a 400
``BadRequestError`` like every other route's (vLLM's own validation answers the type
``Bad Request``). ``load_inplace`` is vLLM's; ``lora_int_id`` on an unload is accepted and
ignored; other fields are ignored. The load takes its modelled time before the answer
(``_lora.py``), the unload ``UNLOAD_S``.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict

from gpufleet.engine.server._asgi import (
    ClientGoneError,
    Receive,
    Scope,
    Send,
    parse_body,
    read_json,
    send_bytes,
    send_error,
    until_disconnect,
)
from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import ApiError, BadRequestError
from gpufleet.engine.server._lora import LoraAdapters

NOT_ENABLED = "LoRA is not enabled. Use --enable-lora to enable LoRA."


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    lora_name: str
    lora_int_id: int | None = None


async def _text(send: Send, text: str) -> None:
    body = text.encode()
    await send_bytes(send, 200, body, [(b"content-length", str(len(body)).encode())])


class _LoraRoute:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            payload = await read_json(receive)
            if self.engine.faults.config.hang:
                await until_disconnect(receive, asyncio.Event().wait())
                return
            text = await self.run(payload)
        except ClientGoneError:
            return
        except ApiError as error:
            await send_error(send, error)
            return
        await _text(send, text)

    def adapters(self) -> LoraAdapters:
        if self.engine.lora is None:
            raise BadRequestError(NOT_ENABLED)
        return self.engine.lora

    async def run(self, payload: object) -> str:
        raise NotImplementedError


class LoadLoraAdapter(_LoraRoute):
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}``."""

    async def run(self, payload: object) -> str:
        request = parse_body(LoadLoraAdapterRequest, payload)
        name = request.lora_name
        await self.adapters().load(name, request.lora_path, inplace=request.load_inplace)
        return f"Success: LoRA adapter '{name}' added successfully."


class UnloadLoraAdapter(_LoraRoute):
    """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""

    async def run(self, payload: object) -> str:
        request = parse_body(UnloadLoraAdapterRequest, payload)
        await self.adapters().unload(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
