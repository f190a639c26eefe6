"""The ``gpufleet`` command."""

from gpufleet.cli._app import app, main

__all__ = ["app", "main"]
