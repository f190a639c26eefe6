"""Loading the packaged catalog files (``data/gpus.yaml``, ``data/models.yaml``)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

from gpufleet.catalog._errors import CatalogError, UnknownGPUError, UnknownModelError
from gpufleet.catalog._gpu import GPUSpec
from gpufleet.catalog._model import ModelSpec


def _read_entries(filename: str) -> list[dict[str, Any]]:
    text = resources.files("gpufleet.catalog").joinpath("data", filename).read_text("utf-8")
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise CatalogError(f"{filename}: expected a mapping with an 'entries' list")
    return doc["entries"]


@cache
def load_gpus() -> dict[str, GPUSpec]:
    """All packaged GPUs by name."""
    gpus = [GPUSpec.model_validate(entry) for entry in _read_entries("gpus.yaml")]
    return {gpu.name: gpu for gpu in gpus}


@cache
def load_models() -> dict[str, ModelSpec]:
    """All packaged models by name."""
    models = [ModelSpec.model_validate(entry) for entry in _read_entries("models.yaml")]
    return {model.name: model for model in models}


def get_gpu(name: str) -> GPUSpec:
    gpus = load_gpus()
    key = name.strip().lower()
    if key not in gpus:
        raise UnknownGPUError(name, list(gpus))
    return gpus[key]


def get_model(name: str) -> ModelSpec:
    models = load_models()
    key = name.strip().lower()
    if key not in models:
        raise UnknownModelError(name, list(models))
    return models[key]
