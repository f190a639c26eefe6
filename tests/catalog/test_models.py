"""The packaged model catalog: shapes as in each config.json, and parameter counts derived from
them that match the published model sizes."""

from __future__ import annotations

import pytest

from gpufleet.catalog import ModelSpec, UnknownModelError, get_model, load_models

ALL_MODELS = sorted(load_models())

# Published sizes in billions of parameters (model cards; Hugging Face's safetensors totals).
# Llama 2 70B is sold as "70B" but has 68.98B parameters; the card's "70B" is a round name.
PUBLISHED_BILLIONS = {
    "llama-2-7b": 6.74,
    "llama-2-13b": 13.0,
    "llama-2-70b": 69.0,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "llama-3.1-405b": 405.9,
    "mistral-7b": 7.25,
    "mixtral-8x7b": 46.7,
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-7b": 7.61,
    "qwen2.5-72b": 72.7,
}


def test_catalog_has_the_required_models() -> None:
    assert set(load_models()) == set(PUBLISHED_BILLIONS)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_model_validates_and_cites_its_config(name: str) -> None:
    model = get_model(name)
    assert ModelSpec.model_validate(model.model_dump()) == model
    assert model.name == name
    assert model.hf_id is not None
    assert model.hf_id in model.sources["shapes"]
    assert "config.json" in model.sources["shapes"]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_param_count_matches_the_published_size(name: str) -> None:
    published = PUBLISHED_BILLIONS[name] * 1e9
    assert get_model(name).param_count() == pytest.approx(published, rel=0.02)


def test_exact_param_counts_of_the_checkpoints() -> None:
    # Totals of the safetensors checkpoints: the count is exact, not merely close.
    assert get_model("llama-2-13b").param_count() == 13_015_864_320
    assert get_model("llama-3.1-8b").param_count() == 8_030_261_248
    assert get_model("llama-3.1-70b").param_count() == 70_553_706_496
    assert get_model("llama-3.1-405b").param_count() == 405_853_388_800
    assert get_model("mixtral-8x7b").param_count() == 46_702_792_704
    assert get_model("qwen2.5-7b").param_count() == 7_615_616_512
    assert get_model("qwen2.5-72b").param_count() == 72_706_203_648


def test_mixtral_active_parameters() -> None:
    mixtral = get_model("mixtral-8x7b")
    assert mixtral.is_moe
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    assert mixtral.active_param_count == pytest.approx(12.9e9, rel=0.02)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_dense_models_are_all_active(name: str) -> None:
    model = get_model(name)
    if not model.is_moe:
        assert model.active_param_count == model.param_count()


def test_llama_2_13b_by_hand() -> None:
    model = get_model("llama-2-13b")
    assert model.num_layers == 40
    assert model.hidden_size == 5120
    assert model.num_attention_heads == 40
    assert model.num_kv_heads == 40
    assert model.head_dim == 128
    assert model.intermediate_size == 13824
    assert model.vocab_size == 32000
    assert model.max_context == 4096


def test_gqa_shapes_by_hand() -> None:
    assert (get_model("llama-3.1-70b").num_kv_heads, get_model("llama-3.1-70b").q_dim) == (8, 8192)
    assert get_model("llama-3.1-405b").num_layers == 126
    assert get_model("qwen2.5-7b").kv_dim == 4 * 128
    assert get_model("mistral-7b").vocab_size == 32768


def test_qwen2_has_qkv_bias_and_small_qwen_ties_embeddings() -> None:
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-72b"):
        assert get_model(name).attention_bias
    assert get_model("qwen2.5-0.5b").tie_word_embeddings
    assert get_model("qwen2.5-1.5b").tie_word_embeddings
    assert not get_model("qwen2.5-7b").tie_word_embeddings
    assert not get_model("llama-3.1-8b").attention_bias


def test_tied_embeddings_are_counted_once() -> None:
    tied = get_model("qwen2.5-1.5b")
    untied = tied.model_copy(update={"tie_word_embeddings": False})
    assert untied.param_count() - tied.param_count() == tied.vocab_size * tied.hidden_size


def test_lookup_by_name_ignores_case_and_by_hf_id() -> None:
    assert get_model(" Llama-3.1-8B ") is get_model("llama-3.1-8b")
    assert get_model("meta-llama/Llama-3.1-8B-Instruct") is get_model("llama-3.1-8b")
    assert get_model("qwen/qwen2.5-7b-instruct") is get_model("qwen2.5-7b")


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(UnknownModelError) as info:
        get_model("llama-9-1t")
    message = str(info.value)
    assert "'llama-9-1t'" in message
    assert "config.json" in message
    for name in ALL_MODELS:
        assert name in message
