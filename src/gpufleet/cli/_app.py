"""The ``gpufleet`` command: one typer app, a module per command group."""

from __future__ import annotations

import typer

from gpufleet import __version__
from gpufleet.cli import (
    _catalog_cmd,
    _deploy_cmd,
    _engine_cmd,
    _keys_cmd,
    _plan_cmd,
    _replay_cmd,
    _rollout_cmd,
    _simulate_cmd,
    _trace_cmd,
    _up_cmd,
)

app = typer.Typer(
    name="gpufleet",
    help="Control plane and simulator for GPU clusters that serve LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("plan")(_plan_cmd.plan)
app.command("up")(_up_cmd.up)
app.command("simulate")(_simulate_cmd.simulate)
app.command("replay")(_replay_cmd.replay_cmd)
app.add_typer(_catalog_cmd.app, name="catalog")
app.add_typer(_engine_cmd.app, name="engine")
app.add_typer(_deploy_cmd.app, name="deploy")
app.add_typer(_keys_cmd.app, name="keys")
app.command("usage")(_keys_cmd.usage)
app.add_typer(_trace_cmd.app, name="trace")
app.add_typer(_rollout_cmd.app, name="rollout")


@app.command()
def version() -> None:
    """Print gpufleet's version."""
    typer.echo(__version__)


def main() -> None:
    app()
