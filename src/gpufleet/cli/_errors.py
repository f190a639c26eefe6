"""Bad input ends a command with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pydantic
import typer
from rich.console import Console

USAGE_ERROR = 2

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def describe(error: Exception) -> str:
    """One line for a validation error or any ``ValueError``."""
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "input"
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        return f"{where}: {first['msg']}{more}"
    return str(error)


@contextmanager
def user_errors(rename: Callable[[str], str] = lambda s: s) -> Iterator[None]:
    """Turn ``ValueError`` (pydantic's included) into ``error: …`` and exit status 2."""
    try:
        yield
    except ValueError as error:
        _stderr.print(f"[bold red]error:[/] {rename(describe(error))}")
        raise typer.Exit(USAGE_ERROR) from None
