"""The errors of tenancy (auth, quotas, admission), in the tree of ``_errors``::

GatewayError
├── UnauthorizedError      401  authentication_error   missing, malformed, unknown, revoked key
├── ForbiddenError         403  permission_error       the tenant may not use the model
├── RateLimitedError       429  rate_limit_error       rpm, tpm, concurrency  Retry-After
└── AdmissionError         503  service_unavailable    shed or deadline passed  Retry-After
"""

from __future__ import annotations

from gpufleet.gateway._errors import GatewayError


class UnauthorizedError(GatewayError):
    status = 401
    type = "authentication_error"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b"Bearer")]


class ForbiddenError(GatewayError):
    status = 403
    type = "permission_error"


class _RetryLaterError(GatewayError):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after).encode())]


class RateLimitedError(_RetryLaterError):
    status = 429
    type = "rate_limit_error"


class AdmissionError(_RetryLaterError):
    status = 503
    type = "service_unavailable"
