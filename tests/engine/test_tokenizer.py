"""The stand-in tokenizer: deterministic ids, shared prefixes, chat template, filler text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.engine import WORDS, Tokenizer
from gpufleet.engine._tokenizer import _PIECE, SPECIAL_IDS, _piece_id

VOCAB = 128256
tok = Tokenizer(VOCAB)


def test_ids_are_pinned_across_processes_and_machines() -> None:
    # BLAKE2b, not hash(): these values must never change (prefix-cache hits depend on them).
    assert tok.encode("Hello, world!") == (128240, 6576, 7142, 122637, 2130)


def test_text_splits_into_words_and_punctuation() -> None:
    ids = tok.encode("a  b,c", add_bos=False)
    assert ids == tok.encode("a b , c", add_bos=False)
    assert len(ids) == 4


@given(st.text(max_size=200), st.text(max_size=200))
def test_a_shared_prefix_gives_shared_ids(a: str, b: str) -> None:
    whole = tok.encode(a + " " + b)
    assert whole[: len(tok.encode(a))] == tok.encode(a)


@given(st.text(max_size=300))
def test_ids_stay_in_the_vocabulary_and_count_agrees(text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    assert all(0 <= i < VOCAB - SPECIAL_IDS for i in ids)
    assert tok.count(text) == len(ids)


def test_chat_template_marks_roles_and_ends_with_the_assistant() -> None:
    ids = tok.encode_chat([("system", "Be brief."), ("user", "Hi")])
    assert ids[0] == tok.bos_id
    assert ids.count(tok.end_of_message_id) == 2
    assert ids[-1] >= VOCAB - SPECIAL_IDS
    assert tok.encode_chat([("user", "Hi")]) != tok.encode_chat([("system", "Hi")])
    assert tok.encode_chat([("critic", "Hi")]) != tok.encode_chat([("judge", "Hi")])


def test_chat_prompts_with_a_shared_history_share_a_prefix() -> None:
    history = [("system", "You are a guide."), ("user", "Where is the bridge?")]
    short = tok.encode_chat(history)
    longer = tok.encode_chat([*history, ("assistant", "North."), ("user", "Thanks")])
    assert longer[: len(short) - 1] == short[:-1]


@given(st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=100))
def test_filler_text_retokenizes_to_as_many_ids(ids: list[int]) -> None:
    text = tok.decode(ids)
    assert tok.count(text) == len(ids)
    assert text == "".join(" " + WORDS[i % len(WORDS)] for i in ids)


def test_words_are_distinct_single_pieces() -> None:
    assert len(set(WORDS)) == len(WORDS)
    assert all(tok.count(word) == 1 and word.isascii() for word in WORDS)


def test_a_tiny_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer(100)


@given(st.text(max_size=300))
def test_chunk_cache_gives_the_same_ids_as_splitting_the_whole_text(text: str) -> None:
    fresh = Tokenizer(VOCAB)
    expected = tuple(_piece_id(piece, VOCAB - SPECIAL_IDS) for piece in _PIECE.findall(text))
    assert fresh.encode(text, add_bos=False) == expected
    assert fresh.encode(text, add_bos=False) == expected  # cached the second time


def test_detokenize_names_special_ids_and_reads_others_as_filler_words() -> None:
    ids = tok.encode_chat([("user", "Hi")])
    text = tok.detokenize(ids)
    assert text.startswith("<|begin_of_text|><|user|> ")
    assert text.endswith("<|end|><|assistant|>")
    assert tok.detokenize([7, 8]) == tok.decode([7, 8])
    assert [tok.token_str(i) for i in range(VOCAB - SPECIAL_IDS, VOCAB)][-1] == "<|reserved_15|>"
