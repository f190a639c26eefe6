"""The admin API's route table: each route names the least role that may call it.

::

    AdminRoute("POST", ("keys", "{}", "rotate"), Role.OPERATOR, rotate_key)
    match(routes, "POST", ["keys", "3f9a0c1e2b4d", "rotate"])   # → (route, ["3f9a0c1e2b4d"])

A ``{}`` segment matches any one segment and is passed to the handler. The role is checked
before anything is read or done, in one place (``AdminApi``), so no handler can forget it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pydantic

from gpufleet.gateway._errors import BadRequestError, MethodNotAllowedError, RouteNotFoundError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall

Handler = Callable[["AdminCall"], Awaitable[tuple[int, Any]]]
"""A route's work: the call in, ``(status, JSON answer)`` out."""
Model = TypeVar("Model", bound=pydantic.BaseModel)


def named_body(body: bytes, name: str, why: str, model: type[Model]) -> tuple[str, Model]:
    """A JSON object body: its ``name`` field (a non-empty string; ``why`` says what to put
    there) and the rest validated as ``model``. ``BadRequestError`` (400) says what is wrong,
    with the field's path."""
    try:
        data = json.loads(body or b"{}")
    except ValueError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadRequestError("the body must be a JSON object")
    value = data.pop(name, None)
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"`{name}`: {why}")
    try:
        return value, model.model_validate(data)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise BadRequestError(f"{where}: {message}" if where else message) from None


@dataclass(frozen=True, slots=True)
class AdminRoute:
    method: str
    path: tuple[str, ...]
    """Segments after ``/admin``; ``{}`` matches any one."""
    role: Role
    """The least role that may call it."""
    handler: Handler
    store: bool = True
    """Needs the store (auth on): tenants, keys, usage, audit, admin credentials."""

    def matches(self, parts: Sequence[str]) -> list[str] | None:
        """The ``{}`` segments of ``parts`` if the path matches, else ``None``."""
        if len(parts) != len(self.path):
            return None
        args = []
        for want, got in zip(self.path, parts, strict=True):
            if want == "{}":
                args.append(got)
            elif want != got:
                return None
        return args


def match(
    routes: Sequence[AdminRoute], method: str, parts: Sequence[str]
) -> tuple[AdminRoute, list[str]]:
    """The route for ``method`` on ``parts``: 404 if no route has the path, 405 if none of
    those takes the method."""
    allowed = []
    for route in routes:
        args = route.matches(parts)
        if args is None:
            continue
        if route.method == method:
            return route, args
        allowed.append(route.method)
    where = "/admin/" + "/".join(parts)
    if allowed:
        raise MethodNotAllowedError(f"{method} is not allowed here (use {', '.join(allowed)})")
    raise RouteNotFoundError(f"no admin route {method} {where}")
