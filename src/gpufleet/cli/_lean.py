"""``gpufleet simulate`` without the rest of the command: an app of that one command.

The whole app (``gpufleet.cli._app``) imports every command's module, and some of those
import the gateway, the store (SQLAlchemy) and the Kubernetes client: about 2 s on a slow
machine, most of a short simulation's wall time. The lean app registers only the command
named on the command line, with the same options and help; ``gpufleet --help`` and every
other command take the whole app. ``tests/cli/test_lean.py`` checks that the two agree.
"""

from __future__ import annotations

import typer

LEAN = ("simulate",)
"""Commands with a lean app."""


def lean_app(argv: list[str]) -> typer.Typer | None:
    """The app for ``gpufleet argv[0] …`` when that command has a lean one, else ``None``."""
    if not argv or argv[0] not in LEAN:
        return None
    from gpufleet.cli._simulate_cmd import simulate  # noqa: PLC0415

    app = typer.Typer(
        name="gpufleet",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _group() -> None:
        """A group, as in the whole app: the command is named on the command line."""

    app.command("simulate")(simulate)
    return app
