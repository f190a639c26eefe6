"""The hooks through which ``Gateway._route`` tells a request's trace what happens to it:
the interface here, spans in ``_tracing.RequestTrace``. Tracing off, a request has no
``Spans`` (``None``) and the hooks are not called: no OpenTelemetry import, no calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufleet.control import Reject, Route
from gpufleet.fleet import Outcome

if TYPE_CHECKING:
    from gpufleet.gateway._tenancy import Admitted


class Spans:
    """A request's trace hooks, in the order ``_route`` calls them (these do nothing)."""

    __slots__ = ()

    def model(self, model: str) -> None:
        """The body names ``model``."""

    def deciding(self) -> None:
        """The controller is asked for the request's (next) decision."""

    def decided(self, decision: Route | Reject) -> None:
        """... and gave it."""

    def attempt(
        self, route: Route, pool: str, url: str, headers: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        """An attempt starts on ``route.replica``: the headers it sends upstream."""
        return headers

    def attempt_ended(
        self,
        outcome: Outcome,
        status: int | None = None,
        error: BaseException | None = None,
        *,
        broke: bool = False,
    ) -> None:
        """The attempt ended: answered with ``status``, failed with ``error`` before the
        first byte, or ``broke`` after it (its stream cut)."""

    def end(self, status: int, admitted: Admitted | None = None) -> None:
        """The request is answered with ``status`` (499: the client left)."""
