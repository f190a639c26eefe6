"""A user's own model, read from a Hugging Face ``config.json``.

Only the decoder-only families whose parameters :class:`ModelSpec` counts exactly are accepted
(``model_type`` llama, mistral, mixtral, qwen2); anything else is refused rather than planned
with a wrong weight size. Every failure is a one-line :class:`CatalogError` naming the file and,
where there is one, the field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias

from pydantic import ValidationError

from gpufleet.catalog._errors import CatalogError
from gpufleet.catalog._model import ModelSpec

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2"})
# Qwen2 always has q/k/v biases; its config.json has no key saying so.
_QKV_BIAS_ALWAYS = frozenset({"qwen2"})
# transformers' MixtralConfig defaults, used when a mixtral config.json leaves them out.
_MIXTRAL_DEFAULT_EXPERTS = 8
_MIXTRAL_DEFAULT_EXPERTS_PER_TOKEN = 2

_NAME_INVALID = re.compile(r"[^a-z0-9._-]+")
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_Config: TypeAlias = Mapping[str, object]


def model_from_hf_config(path: str | os.PathLike[str], *, name: str | None = None) -> ModelSpec:
    """The model described by a Hugging Face ``config.json`` (a file, or a folder holding one).

    The name is ``name`` if given, else the model's folder name (in a Hugging Face cache
    snapshot, the repository name), else ``_name_or_path``, lowercased into catalog form.
    """
    file = _config_file(Path(path).expanduser())
    config = _read_object(file)
    model_type = _required_str(file, config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise CatalogError(
            f"{file}: model_type {model_type!r} is not supported (supported: {supported})"
        )

    hidden_size = _required_int(file, config, "hidden_size")
    num_heads = _required_int(file, config, "num_attention_heads")
    head_dim = _optional_int(file, config, "head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise CatalogError(
                f"{file}: no 'head_dim', and hidden_size ({hidden_size}) is not a multiple "
                f"of num_attention_heads ({num_heads})"
            )
        head_dim = hidden_size // num_heads
    num_experts, experts_per_token = _experts(file, config, model_type)
    if model_type in _QKV_BIAS_ALWAYS:
        attention_bias = True
    else:
        attention_bias = _optional_bool(file, config, "attention_bias") or False
    display_name = name or _display_name(file, config)

    try:
        return ModelSpec(
            name=_catalog_name(display_name, file),
            display_name=display_name,
            hf_id=_hf_id(config),
            architecture=model_type,
            num_layers=_required_int(file, config, "num_hidden_layers"),
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_kv_heads=_optional_int(file, config, "num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=_required_int(file, config, "intermediate_size"),
            vocab_size=_required_int(file, config, "vocab_size"),
            max_context=_required_int(file, config, "max_position_embeddings"),
            num_experts=num_experts,
            experts_per_token=experts_per_token,
            tie_word_embeddings=_optional_bool(file, config, "tie_word_embeddings") or False,
            attention_bias=attention_bias,
            sources={"shapes": str(file)},
        )
    except ValidationError as exc:
        raise CatalogError(f"{file}: {_first_error(exc)}") from None


def looks_like_path(text: str) -> bool:
    """Whether a model argument is meant as a file path rather than a catalog name."""
    return text.endswith(".json") or text.startswith(("/", "./", "../", "~"))


def _config_file(path: Path) -> Path:
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise CatalogError(f"{path}: folder has no config.json")
        return file
    if not path.exists():
        raise CatalogError(f"{path}: no such file or folder")
    return path


def _read_object(file: Path) -> _Config:
    try:
        text = file.read_text("utf-8")
    except OSError as exc:
        raise CatalogError(f"{file}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{file}: cannot read: not UTF-8 text") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(
            f"{file}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(doc, dict):
        raise CatalogError(f"{file}: expected a JSON object, got {_json_type(doc)}")
    return doc


def _experts(file: Path, config: _Config, model_type: str) -> tuple[int, int]:
    if model_type != "mixtral":
        return 1, 1
    experts = _optional_int(file, config, "num_local_experts") or _MIXTRAL_DEFAULT_EXPERTS
    per_token = (
        _optional_int(file, config, "num_experts_per_tok") or _MIXTRAL_DEFAULT_EXPERTS_PER_TOKEN
    )
    return experts, per_token


def _required_str(file: Path, config: _Config, key: str) -> str:
    value = config.get(key)
    if value is None:
        raise CatalogError(f"{file}: missing field {key!r}")
    if not isinstance(value, str):
        raise CatalogError(f"{file}: field {key!r} must be a string, got {_json_type(value)}")
    return value


def _required_int(file: Path, config: _Config, key: str) -> int:
    value = _optional_int(file, config, key)
    if value is None:
        raise CatalogError(f"{file}: missing field {key!r}")
    return value


def _optional_int(file: Path, config: _Config, key: str) -> int | None:
    """A positive integer field; ``None`` when absent or JSON null."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CatalogError(f"{file}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _optional_bool(file: Path, config: _Config, key: str) -> bool | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise CatalogError(f"{file}: field {key!r} must be true or false, got {value!r}")
    return value


def _display_name(file: Path, config: _Config) -> str:
    folder = file.parent.resolve()
    # Hugging Face cache: models--<org>--<name>/snapshots/<revision>/config.json
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.rsplit("--", 1)[-1]
    if _NAME_INVALID.sub("", folder.name.lower()):
        return folder.name
    name_or_path = config.get("_name_or_path")
    if isinstance(name_or_path, str) and name_or_path.strip("/ "):
        return name_or_path.rstrip("/").rsplit("/", 1)[-1]
    return "custom-model"


def _catalog_name(display_name: str, file: Path) -> str:
    name = _NAME_INVALID.sub("-", display_name.strip().lower()).strip("-._")
    if not name:
        raise CatalogError(f"{file}: cannot make a model name from {display_name!r}")
    return name


def _hf_id(config: _Config) -> str | None:
    value = config.get("_name_or_path")
    if isinstance(value, str) and _HF_REPO_ID.match(value) and not Path(value).exists():
        return value
    return None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _json_type(value: object) -> str:
    names: list[tuple[type, str]] = [
        (bool, "a boolean"),
        (int, "a number"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ]
    for kind, label in names:
        if isinstance(value, kind):
            return label
    return "null" if value is None else type(value).__name__
