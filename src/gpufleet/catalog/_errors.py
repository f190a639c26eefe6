"""Errors of the catalog. All are ``ValueError``: they describe bad input, not bugs."""

from __future__ import annotations


class CatalogError(ValueError):
    """A GPU or model could not be found or read."""


class UnknownGPUError(CatalogError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(known))}")


class UnknownModelError(CatalogError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(
            f"unknown model {name!r}; known models: {', '.join(sorted(known))} "
            "(or give the path of a Hugging Face config.json)"
        )
