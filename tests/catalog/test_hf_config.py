"""A user's own model from a Hugging Face config.json: round trips, naming, and bad files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.catalog import (
    CatalogError,
    ModelSpec,
    UnknownModelError,
    get_model,
    load_models,
    model_from_hf_config,
)

SHAPE_FIELDS = {
    "architecture",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_context",
    "num_experts",
    "experts_per_token",
    "tie_word_embeddings",
    "attention_bias",
}


def hf_config(model: ModelSpec) -> dict[str, Any]:
    """The config.json that transformers would write for these shapes (plus unrelated keys)."""
    config: dict[str, Any] = {
        "_name_or_path": model.hf_id,
        "architectures": [f"{model.architecture.capitalize()}ForCausalLM"],
        "model_type": model.architecture,
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_context,
        "tie_word_embeddings": model.tie_word_embeddings,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    if model.architecture == "llama":
        config["attention_bias"] = model.attention_bias
    if model.architecture == "mixtral":
        config["num_local_experts"] = model.num_experts
        config["num_experts_per_tok"] = model.experts_per_token
    return config


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "config.json"
    file.write_text(json.dumps(config, indent=2), "utf-8")
    return file


def shapes(model: ModelSpec) -> dict[str, Any]:
    return model.model_dump(include=SHAPE_FIELDS)


@pytest.mark.parametrize("name", sorted(load_models()))
def test_round_trip_through_config_json(tmp_path: Path, name: str) -> None:
    model = get_model(name)
    file = write_config(tmp_path / name, hf_config(model))

    read = model_from_hf_config(file)

    assert shapes(read) == shapes(model)
    assert read.param_count() == model.param_count()
    assert read.active_param_count == model.active_param_count
    assert read.name == name
    assert read.hf_id == model.hf_id
    assert read.sources == {"shapes": str(file)}


def test_folder_file_and_path_object_all_work(tmp_path: Path) -> None:
    model = get_model("llama-3.1-8b")
    file = write_config(tmp_path / "my-model", hf_config(model))
    by_file = get_model(str(file))
    assert get_model(str(file.parent)) == by_file
    assert get_model(file) == by_file
    assert model_from_hf_config(file.parent) == by_file
    assert shapes(by_file) == shapes(model)


def test_defaults_for_optional_fields(tmp_path: Path) -> None:
    config = hf_config(get_model("llama-2-7b"))
    for key in ("num_key_value_heads", "tie_word_embeddings", "attention_bias"):
        del config[key]
    model = model_from_hf_config(write_config(tmp_path / "m", config))
    assert model.num_kv_heads == model.num_attention_heads == 32
    assert model.head_dim == 4096 // 32
    assert not model.tie_word_embeddings
    assert not model.attention_bias


def test_null_optional_fields_take_their_defaults(tmp_path: Path) -> None:
    config = hf_config(get_model("mistral-7b")) | {"head_dim": None, "num_key_value_heads": None}
    model = model_from_hf_config(write_config(tmp_path / "m", config))
    assert (model.head_dim, model.num_kv_heads) == (128, 32)


def test_explicit_head_dim_wins(tmp_path: Path) -> None:
    # Mistral-Nemo style: 5120 hidden, 32 heads of 128 (not 5120 / 32 = 160).
    config = hf_config(get_model("mistral-7b")) | {"hidden_size": 5120, "head_dim": 128}
    model = model_from_hf_config(write_config(tmp_path / "m", config))
    assert model.head_dim == 128
    assert model.q_dim == 4096


def test_qwen2_implies_qkv_bias(tmp_path: Path) -> None:
    config = hf_config(get_model("qwen2.5-7b"))
    assert "attention_bias" not in config
    assert model_from_hf_config(write_config(tmp_path / "q", config)).attention_bias


def test_llama_attention_bias_is_read(tmp_path: Path) -> None:
    config = hf_config(get_model("llama-3.1-8b")) | {"attention_bias": True}
    assert model_from_hf_config(write_config(tmp_path / "m", config)).attention_bias


def test_mixtral_expert_counts_default_like_transformers(tmp_path: Path) -> None:
    config = hf_config(get_model("mixtral-8x7b"))
    del config["num_local_experts"], config["num_experts_per_tok"]
    model = model_from_hf_config(write_config(tmp_path / "m", config))
    assert (model.num_experts, model.experts_per_token) == (8, 2)


def test_expert_keys_are_ignored_outside_mixtral(tmp_path: Path) -> None:
    config = hf_config(get_model("llama-2-7b")) | {"num_local_experts": 8}
    assert not model_from_hf_config(write_config(tmp_path / "m", config)).is_moe


def test_name_from_the_folder(tmp_path: Path) -> None:
    file = write_config(tmp_path / "Acme_Chat-8B v2", hf_config(get_model("llama-3.1-8b")))
    model = model_from_hf_config(file)
    assert model.name == "acme_chat-8b-v2"
    assert model.display_name == "Acme_Chat-8B v2"


def test_name_from_a_hugging_face_cache_snapshot(tmp_path: Path) -> None:
    folder = tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "a09a3545"
    model = model_from_hf_config(write_config(folder, hf_config(get_model("qwen2.5-7b"))))
    assert model.name == "qwen2.5-7b-instruct"
    assert model.display_name == "Qwen2.5-7B-Instruct"


def test_name_from_name_or_path_when_the_folder_gives_none(tmp_path: Path) -> None:
    config = hf_config(get_model("llama-2-7b")) | {"_name_or_path": "acme/Tiny-Llama"}
    model = model_from_hf_config(write_config(tmp_path / "@@@", config))
    assert model.name == "tiny-llama"
    assert model.hf_id == "acme/Tiny-Llama"


def test_explicit_name(tmp_path: Path) -> None:
    file = write_config(tmp_path / "x", hf_config(get_model("llama-2-7b")))
    model = model_from_hf_config(file, name="Team Model (prod)")
    assert (model.name, model.display_name) == ("team-model-prod", "Team Model (prod)")


def test_local_name_or_path_is_not_an_hf_id(tmp_path: Path) -> None:
    config = hf_config(get_model("llama-2-7b")) | {"_name_or_path": "/home/me/checkpoints/step-9"}
    assert model_from_hf_config(write_config(tmp_path / "m", config)).hf_id is None


def _valid() -> dict[str, Any]:
    return hf_config(get_model("llama-3.1-8b"))


def _without(key: str) -> dict[str, Any]:
    config = _valid()
    del config[key]
    return config


BAD_CONFIGS: dict[str, tuple[str | bytes, str]] = {
    # case: (file content, text the one-line message must contain besides the file name)
    "not-json": ('{"model_type": "llama",', "not valid JSON"),
    "empty": ("", "not valid JSON"),
    "array": ("[1, 2]", "expected a JSON object, got an array"),
    "not-utf8": (b"\xff\xfe{}", "not UTF-8"),
    "no-model-type": (json.dumps(_without("model_type")), "missing field 'model_type'"),
    "model-type-number": (
        json.dumps(_valid() | {"model_type": 7}),
        "'model_type' must be a string",
    ),
    "unsupported": (json.dumps(_valid() | {"model_type": "gpt2"}), "model_type 'gpt2'"),
    "no-hidden-size": (json.dumps(_without("hidden_size")), "missing field 'hidden_size'"),
    "no-layers": (json.dumps(_without("num_hidden_layers")), "missing field 'num_hidden_layers'"),
    "no-vocab": (json.dumps(_without("vocab_size")), "missing field 'vocab_size'"),
    "no-context": (
        json.dumps(_without("max_position_embeddings")),
        "missing field 'max_position_embeddings'",
    ),
    "string-int": (json.dumps(_valid() | {"hidden_size": "4096"}), "'hidden_size' must be"),
    "float-int": (json.dumps(_valid() | {"vocab_size": 32000.5}), "'vocab_size' must be"),
    "bool-int": (json.dumps(_valid() | {"num_hidden_layers": True}), "'num_hidden_layers' must"),
    "zero": (json.dumps(_valid() | {"num_hidden_layers": 0}), "'num_hidden_layers' must be"),
    "negative-kv": (json.dumps(_valid() | {"num_key_value_heads": -8}), "'num_key_value_heads'"),
    "string-bool": (
        json.dumps(_valid() | {"tie_word_embeddings": "yes"}),
        "'tie_word_embeddings' must be true or false",
    ),
    "kv-not-divisor": (
        json.dumps(_valid() | {"num_key_value_heads": 5}),
        "must be a multiple of num_kv_heads",
    ),
    "head-dim-underivable": (
        json.dumps(_valid() | {"hidden_size": 4100}),
        "no 'head_dim'",
    ),
    "too-many-active-experts": (
        json.dumps(
            hf_config(get_model("mixtral-8x7b"))
            | {"num_local_experts": 2, "num_experts_per_tok": 4}
        ),
        "experts_per_token cannot exceed num_experts",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_clear_catalog_error(tmp_path: Path, case: str) -> None:
    content, expected = BAD_CONFIGS[case]
    file = tmp_path / case / "config.json"
    file.parent.mkdir()
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content, "utf-8")

    for call in (lambda: model_from_hf_config(file), lambda: get_model(str(file))):
        with pytest.raises(CatalogError) as info:
            call()
        message = str(info.value)
        assert str(file) in message
        assert expected in message
        assert "\n" not in message
        # No KeyError / JSONDecodeError / pydantic ValidationError chained into the traceback.
        assert info.value.__cause__ is None
        assert info.value.__suppress_context__ or info.value.__context__ is None


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(CatalogError, match="no such file or folder") as info:
        get_model(str(missing))
    assert not isinstance(info.value, UnknownModelError)
    assert str(missing) in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"folder has no config\.json"):
        model_from_hf_config(tmp_path)


def test_a_name_that_is_neither_catalog_nor_path_is_unknown() -> None:
    with pytest.raises(UnknownModelError):
        get_model("acme/not-in-the-catalog")
