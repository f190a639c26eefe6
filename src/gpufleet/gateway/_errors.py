"""Every error the gateway answers, as one tree, mapped to OpenAI-shaped JSON in one place.

::

    GatewayError                      status  type                   retry
    ├── BadRequestError                    400     invalid_request_error  —
    ├── ModelNotFoundError                 404     not_found_error        —
    ├── RouteNotFoundError                 404     not_found_error        —
    ├── NotFoundError                      404     not_found_error        —   (a file, a batch)
    ├── MethodNotAllowedError              405     invalid_request_error  —
    ├── ConflictError                      409     invalid_request_error  —   (batch ended)
    ├── PayloadTooLargeError               413     invalid_request_error  —
    ├── NoReplicaError                     503     service_unavailable    Retry-After
    └── UpstreamError               (an attempt's outcome; never reaches a client as such)
        ├── LocalOriginError        connect failure, timeout      retryable before 1st byte
        └── ReplicaOriginError      a 5xx from the replica        retryable before 1st byte

An ``UpstreamError`` before the first byte moves the request to the next replica of its
ranking; when the ranking or the retry budget is used up the client gets ``NoReplicaError`` (503,
``Retry-After``). One after the first byte of a stream ends the stream with an error event
(:func:`error_event`) and ``data: [DONE]`` (a Responses API stream: its ``error`` event,
:func:`response_error_event`). A replica's 4xx is its answer, passed through.
"""

from __future__ import annotations

import json
from typing import ClassVar

from gpufleet.fleet import Outcome


class GatewayError(Exception):
    """An error answered to the client: ``status`` and an OpenAI ``type``."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class BadRequestError(GatewayError):
    status = 400
    type = "invalid_request_error"


class ModelNotFoundError(GatewayError):
    status = 404
    type = "not_found_error"


class RouteNotFoundError(GatewayError):
    status = 404
    type = "not_found_error"


class NotFoundError(GatewayError):
    """A file or batch that does not exist, or is another tenant's."""

    status = 404
    type = "not_found_error"


class MethodNotAllowedError(GatewayError):
    status = 405
    type = "invalid_request_error"


class ConflictError(GatewayError):
    """The object's state does not allow it (cancelling a batch that already ended)."""

    status = 409
    type = "invalid_request_error"


class RequestTimeoutError(GatewayError):
    """The request body did not arrive in time (the connection then closes)."""

    status = 408
    type = "invalid_request_error"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"connection", b"close")]


class PayloadTooLargeError(GatewayError):
    status = 413
    type = "invalid_request_error"


class NoReplicaError(GatewayError):
    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after).encode())]


class UpstreamError(Exception):
    """One attempt on one replica failed; ``outcome`` is what outlier detection counts."""

    outcome: Outcome = Outcome.CONNECT_FAILURE


class LocalOriginError(UpstreamError):
    """The gateway could not reach the replica, or gave up waiting (Envoy's local origin)."""

    def __init__(self, message: str, outcome: Outcome = Outcome.CONNECT_FAILURE) -> None:
        super().__init__(message)
        self.outcome = outcome


class ReplicaOriginError(UpstreamError):
    """The replica answered with a server error."""

    outcome = Outcome.REPLICA_ERROR

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, type_: str, message: str) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": status}}
    ).encode()


def error_event(message: str) -> bytes:
    """The SSE events that end a stream broken after its first byte."""
    return b"data: " + error_body(502, "upstream_error", message) + b"\n\ndata: [DONE]\n\n"


def response_error_event(message: str) -> bytes:
    """The event that ends a Responses API stream broken after its first byte: that API's
    ``error`` event (``type``, ``code``, ``message``, ``param``; the gateway does not know
    the stream's ``sequence_number``), with the OpenAI ``error`` object beside them, on which
    the openai client raises ``APIError`` as it does for a chat stream's. No ``[DONE]``: the
    API has none."""
    error = json.loads(error_body(502, "upstream_error", message))["error"]
    event = {"type": "error", "code": "upstream_error", "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps({**event, "error": error}).encode() + b"\n\n"
