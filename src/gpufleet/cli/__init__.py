"""The ``gpufleet`` command.

``app`` (the whole typer app) is imported on first use. ``main`` builds it too, except for
``gpufleet simulate``, which builds an app of that one command: the others' modules import
the gateway, the store and the Kubernetes client (about 2 s), and a simulation needs none
of them (:mod:`gpufleet.cli._lean`).
"""

from __future__ import annotations

import sys
import typing

if typing.TYPE_CHECKING:
    from gpufleet.cli._app import app

__all__ = ["app", "main"]


def main() -> None:
    from gpufleet.cli._lean import lean_app  # noqa: PLC0415 - the lazy entry point

    lean = lean_app(sys.argv[1:2])
    if lean is not None:
        lean()
        return
    from gpufleet.cli._app import main as full  # noqa: PLC0415

    full()


def __getattr__(name: str) -> object:
    if name == "app":
        from gpufleet.cli._app import app  # noqa: PLC0415

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
