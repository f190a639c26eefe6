"""What can go wrong in a sim engine request, and the one place it becomes an HTTP answer.

The tree (STYLE 13); every leaf is mapped to vLLM's error body by ``error_body``::

    ApiError                        status  type                   retryable
    ├── BadRequestError             400     BadRequestError        no   the client's fault:
    │   ├── InvalidJSONError                                            body is not JSON
    │   ├── InvalidRequestError                                         a field missing/wrong
    │   ├── PromptTooLongError                                          the model refused it
    │   └── UnsupportedError                                            n > 1, prompt batches
    ├── InvalidUserInputError       400     InvalidUserInput       no   a LoRA route's own check
    ├── NotFoundError               404     NotFoundError          no   unknown model or route
    ├── MethodNotAllowedError       405     MethodNotAllowedError  no
    ├── PayloadTooLargeError        413     PayloadTooLargeError   no
    ├── LoraLoadError               500     InternalServerError    no   the adapter cannot load
    ├── EngineUnavailableError      500     InternalServerError    yes  the engine loop died
    ├── InjectedFaultError          500     InternalServerError    yes  fault injection only
    └── InjectedOverloadError       503     ServiceUnavailableError yes  fault injection
                                                                         (error_status 503)

Anything else that escapes a handler is a bug: it answers 500 ``InternalServerError`` too, and
is logged with its traceback. The body is vLLM's ``ErrorResponse``::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

``code`` is the HTTP status as vLLM sends it (OpenAI's own API puts a string there; the
official client reads either).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import ClassVar


class ApiError(Exception):
    """An expected failure of one request, with the status and type it answers with."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "InternalServerError"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequestError(ApiError):
    status = 400
    type = "BadRequestError"


class InvalidJSONError(BadRequestError):
    pass


class InvalidRequestError(BadRequestError):
    pass


class PromptTooLongError(BadRequestError):
    pass


class UnsupportedError(BadRequestError):
    pass


class InvalidUserInputError(ApiError):
    """vLLM's ``InvalidUserInput``: a LoRA route's request that names no adapter, or one
    already loaded (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)."""

    status = 400
    type = "InvalidUserInput"


class NotFoundError(ApiError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowedError(ApiError):
    status = 405
    type = "MethodNotAllowedError"


class PayloadTooLargeError(ApiError):
    status = 413
    type = "PayloadTooLargeError"


class LoraLoadError(ApiError):
    """An adapter the engine cannot load (a rank above ``--max-lora-rank``, an unreadable
    config): vLLM answers its engine's refusal as a 500, with the engine's message."""

    status = 500
    type = "InternalServerError"


class EngineUnavailableError(ApiError):
    status = 500
    type = "InternalServerError"
    retryable = True


class InjectedFaultError(ApiError):
    status = 500
    type = "InternalServerError"
    retryable = True


class InjectedOverloadError(ApiError):
    """An injected error answered 503, as an overloaded engine (or a proxy before one) does."""

    status = 503
    type = "ServiceUnavailableError"
    retryable = True


class ModelSleepingError(ApiError):
    """A request that needs the weights while the engine sleeps (``POST /sleep``)."""

    status = 503
    type = "ServiceUnavailableError"
    retryable = True


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse`` as JSON bytes."""
    error = {"message": message, "type": type_, "param": param, "code": status}
    return json.dumps({"error": error}).encode()


def describe(error: BaseException) -> tuple[int, bytes]:
    """The status and body for any exception that reaches the edge."""
    if isinstance(error, ApiError):
        return error.status, error_body(error.status, error.message, error.type, error.param)
    return 500, error_body(500, "internal error in the sim engine", "InternalServerError")


def http_error(status: int, detail: str | None = None) -> ApiError:
    """The tree's leaf for a status Starlette's router raises (unknown route, wrong method)."""
    phrase = HTTPStatus(status).phrase
    message = detail if detail and detail != phrase else phrase
    if status == 404:
        return NotFoundError(message)
    if status == 405:
        return MethodNotAllowedError(message)
    if status == 413:
        return PayloadTooLargeError(message)
    if 400 <= status < 500:
        return BadRequestError(message)
    return ApiError(message)
