"""Loading the packaged catalog files (``data/gpus.yaml``, ``data/models.yaml``)."""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from gpufleet.catalog._errors import CatalogError, UnknownGPUError, UnknownModelError
from gpufleet.catalog._gpu import GPUSpec
from gpufleet.catalog._hf import looks_like_path, model_from_hf_config
from gpufleet.catalog._model import ModelSpec

_Spec = TypeVar("_Spec", GPUSpec, ModelSpec)


def _read_entries(filename: str) -> list[Any]:
    text = resources.files("gpufleet.catalog").joinpath("data", filename).read_text("utf-8")
    doc = yaml.safe_load(text)
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise CatalogError(f"{filename}: expected a mapping with an 'entries' list")
    return entries


def _load(filename: str, spec: type[_Spec]) -> dict[str, _Spec]:
    """Every entry of a packaged file, validated, by name; a bad entry is one CatalogError."""
    by_name: dict[str, _Spec] = {}
    for index, entry in enumerate(_read_entries(filename)):
        label = entry.get("name", f"#{index}") if isinstance(entry, dict) else f"#{index}"
        try:
            item = spec.model_validate(entry)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "entry"
            raise CatalogError(f"{filename}: {label}: {where}: {error['msg']}") from None
        if item.name in by_name:
            raise CatalogError(f"{filename}: duplicate entry {item.name!r}")
        by_name[item.name] = item
    return by_name


@cache
def load_gpus() -> dict[str, GPUSpec]:
    """All packaged GPUs by name."""
    return _load("gpus.yaml", GPUSpec)


@cache
def load_models() -> dict[str, ModelSpec]:
    """All packaged models by name."""
    return _load("models.yaml", ModelSpec)


def get_gpu(name: str) -> GPUSpec:
    gpus = load_gpus()
    key = name.strip().lower()
    if key not in gpus:
        raise UnknownGPUError(name, list(gpus))
    return gpus[key]


def get_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A catalog model by name (or by its Hugging Face id), or a user's own ``config.json``.

    A path may name the ``config.json`` itself or the folder that holds it.
    """
    if not isinstance(name_or_path, str):
        return model_from_hf_config(name_or_path)
    models = load_models()
    key = name_or_path.strip().lower()
    if key in models:
        return models[key]
    for model in models.values():
        if model.hf_id is not None and model.hf_id.lower() == key:
            return model
    if looks_like_path(name_or_path.strip()) or Path(name_or_path).expanduser().exists():
        return model_from_hf_config(name_or_path.strip())
    raise UnknownModelError(name_or_path, list(models))
