"""``gpufleet rollout``: start, watch and steer a running gateway's rollouts through its admin
API (``/admin/rollouts``; docs/fleet-file.md, "Rollouts").

::

    gpufleet rollout start --model chat --to llama-v2 --steps 5,20,100 --step-seconds 60
    gpufleet rollout status [--model chat]
    gpufleet rollout promote|pause|resume|abort --model chat

The gateway is ``--url`` (``$GPUFLEET_URL``, default ``http://127.0.0.1:8000``); the
credential ``--admin-key`` (``$GPUFLEET_ADMIN_KEY``): an operator's to act, a viewer's to
read. Each command prints the rollout's status as JSON; a refusal prints the gateway's
error on one line and exits 1 (2 for bad input here).
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer

from gpufleet.cli._errors import user_errors

app = typer.Typer(
    help="Canary and blue-green rollouts of a running gateway's served names.",
    no_args_is_help=True,
)

UrlOption = Annotated[
    str, typer.Option("--url", envvar="GPUFLEET_URL", help="The gateway's base URL.")
]
KeyOption = Annotated[
    str | None,
    typer.Option(
        "--admin-key", envvar="GPUFLEET_ADMIN_KEY", help="An admin credential (operator to act)."
    ),
]
ModelOption = Annotated[str, typer.Option("--model", help="The served name (what clients send).")]
DEFAULT_URL = "http://127.0.0.1:8000"


def _call(url: str, key: str | None, method: str, path: str, body: Any = None) -> Any:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    try:
        answer = httpx.request(
            method, url.rstrip("/") + path, json=body, headers=headers, timeout=30
        )
    except httpx.HTTPError as error:
        typer.echo(f"error: cannot reach the gateway at {url}: {error}", err=True)
        raise typer.Exit(1) from None
    try:
        data = answer.json()
    except ValueError:
        data = None
    if answer.status_code >= 400:
        message = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
        typer.echo(f"error: {answer.status_code}: {message or answer.text[:300]}", err=True)
        raise typer.Exit(1)
    return data


def _steps(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--steps: {text!r} is not a list of shares, e.g. 5,20,100") from None


@app.command("start")
def start(
    model: ModelOption,
    to: Annotated[str, typer.Option("--to", help="The new variant (a pool of the name).")],
    steps: Annotated[str | None, typer.Option(help="Canary shares in %, e.g. 5,20,50,100.")] = None,
    step_seconds: Annotated[
        float | None, typer.Option(help="Seconds each step runs before its analysis.")
    ] = None,
    strategy: Annotated[str | None, typer.Option(help="canary (default) or blue-green.")] = None,
    url: UrlOption = DEFAULT_URL,
    admin_key: KeyOption = None,
) -> None:
    """Start rolling served name MODEL out to variant TO."""
    body: dict[str, Any] = {"model": model, "to": to}
    with user_errors():
        if steps is not None:
            body["steps"] = _steps(steps)
    if step_seconds is not None:
        body["step_seconds"] = step_seconds
    if strategy is not None:
        body["strategy"] = strategy
    typer.echo(json.dumps(_call(url, admin_key, "POST", "/admin/rollouts", body), indent=2))


@app.command("status")
def status(
    model: Annotated[str | None, typer.Option("--model", help="One served name.")] = None,
    url: UrlOption = DEFAULT_URL,
    admin_key: KeyOption = None,
) -> None:
    """Every rollout's status (or MODEL's): step, share, weights, the last verdict."""
    path = "/admin/rollouts" if model is None else f"/admin/rollouts/{quote(model, safe='')}"
    typer.echo(json.dumps(_call(url, admin_key, "GET", path), indent=2))


def _action(name: str, doc: str) -> None:
    def command(
        model: ModelOption, url: UrlOption = DEFAULT_URL, admin_key: KeyOption = None
    ) -> None:
        answer = _call(url, admin_key, "POST", f"/admin/rollouts/{quote(model, safe='')}/{name}")
        typer.echo(json.dumps(answer, indent=2))

    command.__doc__ = doc
    app.command(name)(command)


_action("promote", "Go to the next step now, with no analysis (a paused rollout resumes).")
_action("pause", "Hold the rollout at its step: weights stay, no verdict until resumed.")
_action("resume", "Resume a paused rollout with the time its step had left.")
_action("abort", "Stop the rollout: the new variant gets no new request, the old ones all.")
