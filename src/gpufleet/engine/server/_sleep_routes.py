"""The sleep mode's routes (``gpufleet.engine.server._sleep`` says what they do)."""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from gpufleet.engine.server._asgi import (
    JSON_HEADERS,
    Receive,
    Scope,
    Send,
    send_bytes,
    send_error,
)
from gpufleet.engine.server._errors import ApiError, BadRequestError
from gpufleet.engine.server._sleep import SleepMode

_NOT_ENABLED = "sleep mode is not enabled (start the engine with --enable-sleep-mode)"


def _query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"))


class SleepRoute:
    """``POST /sleep?level=N`` (default 1)."""

    def __init__(self, mode: SleepMode, enabled: bool) -> None:
        self.mode = mode
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if not self.enabled:
                raise BadRequestError(_NOT_ENABLED)
            levels = _query(scope).get("level", ["1"])
            try:
                level = int(levels[-1])
            except ValueError:
                raise BadRequestError(f"level: {levels[-1]!r} is not 1 or 2") from None
            if level not in (1, 2):
                raise BadRequestError(f"level: {level} is not 1 or 2")
        except ApiError as error:
            await send_error(send, error)
            return
        await self.mode.sleep(level)
        await send_bytes(send, 200, b"", [(b"content-length", b"0")])


class WakeRoute:
    """``POST /wake_up`` (``tags`` accepted, see the module docstring)."""

    def __init__(self, mode: SleepMode, enabled: bool) -> None:
        self.mode = mode
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled:
            error = BadRequestError(_NOT_ENABLED)
            await send_error(send, error)
            return
        await self.mode.wake()
        await send_bytes(send, 200, b"", [(b"content-length", b"0")])


class IsSleepingRoute:
    """``GET /is_sleeping``."""

    def __init__(self, mode: SleepMode) -> None:
        self.mode = mode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.dumps({"is_sleeping": self.mode.sleeping}).encode()
        await send_bytes(send, 200, body, JSON_HEADERS)
