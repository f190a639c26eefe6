"""Rollouts in the admin API (what ``gpufleet rollout`` calls)::

    GET  /admin/rollouts                    viewer    every served name's last rollout
    GET  /admin/rollouts/{model}            viewer    one: step, share, weights, last verdict
                                                      and its checks, the window so far
    POST /admin/rollouts                    operator  {"model", "to", "steps", "step_seconds",
                                                      "strategy", "analysis"} → started (201)
    POST /admin/rollouts/{model}/{action}   operator  promote | pause | resume | abort

The controller decides (``control/_rollouts.py``); a request here is one event to it, and
its answer the rollout's status. ``{model}`` is one URL segment: a served name with a
``/`` (``meta-llama/Llama-3.1-8B``) is sent as ``meta-llama%2FLlama-3.1-8B`` (``gpufleet
rollout`` does). Errors are OpenAI-shaped: a body that is not a rollout
400, an unknown name 404, a rollout in progress (or one that is over) 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gpufleet.control import RolloutAct, RolloutAction, RolloutConfig, RolloutStart
from gpufleet.gateway._admin_routes import AdminRoute, named_body
from gpufleet.gateway._errors import BadRequestError, ConflictError, NotFoundError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall

_ACTIONS: Final = ", ".join(a.value for a in RolloutAction)


def _status(call: AdminCall, model: str) -> dict[str, Any]:
    status = call.api.control.control.rollouts.status(model)
    if status is None:
        raise NotFoundError(f"{model!r} has no rollout")
    return status


async def _list(call: AdminCall) -> tuple[int, Any]:
    rollouts = call.api.control.control.rollouts
    return 200, {"rollouts": [rollouts.status(m) for m in rollouts.by_name]}


async def _one(call: AdminCall) -> tuple[int, Any]:
    (model,) = call.args
    return 200, _status(call, model)


async def _start(call: AdminCall) -> tuple[int, Any]:
    model, config = named_body(
        call.body, "model", "name the served model to roll out", RolloutConfig
    )
    control = call.api.control
    if model not in control.control.served:
        served = ", ".join(control.control.served)
        raise NotFoundError(f"no served model {model!r} (served: {served})")
    try:
        control.handle(RolloutStart(model, config))
    except ValueError as error:
        kind = ConflictError if "already" in str(error) else BadRequestError
        raise kind(str(error)) from None
    return 201, _status(call, model)


async def _act(call: AdminCall) -> tuple[int, Any]:
    model, name = call.args
    try:
        action = RolloutAction(name)
    except ValueError:
        raise NotFoundError(f"no rollout action {name!r} (actions: {_ACTIONS})") from None
    _status(call, model)  # 404 first: no rollout of that name
    try:
        call.api.control.handle(RolloutAct(model, action))
    except ValueError as error:
        raise ConflictError(str(error)) from None
    return 200, _status(call, model)


ROLLOUT_ROUTES: Final = (
    AdminRoute("GET", ("rollouts",), Role.VIEWER, _list, store=False),
    AdminRoute("GET", ("rollouts", "{}"), Role.VIEWER, _one, store=False),
    AdminRoute("POST", ("rollouts",), Role.OPERATOR, _start, store=False),
    AdminRoute("POST", ("rollouts", "{}", "{}"), Role.OPERATOR, _act, store=False),
)
"""The rollouts' routes, after the fleet's in the gateway's table."""
