"""Prompt ids from trace requests: equal hash ids share KV blocks, nothing else does."""

from __future__ import annotations

import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel
from gpufleet.sim import PREFIX_BLOCK_TOKENS, PromptBuilder, TraceRequest

VOCAB = 32_000


def request(length: int, hashes: tuple[int, ...] | None = None) -> TraceRequest:
    return TraceRequest(0.0, length, 4, hashes)


def test_equal_hash_ids_give_equal_blocks() -> None:
    prompts = PromptBuilder(VOCAB)
    a = prompts.prompt(0, request(1100, (7, 9, 4)))
    b = prompts.prompt(1, request(600, (7, 9)))
    c = prompts.prompt(2, request(1100, (7, 8, 4)))
    assert (len(a), len(b), len(c)) == (1100, 600, 1100)
    assert a[:600] == b
    assert a[:PREFIX_BLOCK_TOKENS] == c[:PREFIX_BLOCK_TOKENS]
    assert a[512:528] != c[512:528]  # the first 16-token KV block after the shared prefix


def test_prompts_without_hashes_share_nothing() -> None:
    prompts = PromptBuilder(VOCAB)
    first = prompts.prompt(0, request(700))
    assert prompts.prompt(0, request(700)) == first  # deterministic
    for index in (1, 2, VOCAB, VOCAB + 1, 7 * VOCAB * VOCAB):
        assert prompts.prompt(index, request(700))[:16] != first[:16]
    assert prompts.prompt(5, request(3)) == (2, 5, 0)  # shorter than the header
    assert PromptBuilder(VOCAB, seed=1).prompt(0, request(700))[4:] != first[4:]


def test_hash_blocks_and_own_ids_never_collide() -> None:
    prompts = PromptBuilder(VOCAB)
    assert prompts.prompt(3, request(64))[:16] != prompts.prompt(9, request(64, (3,)))[:16]


def test_a_prompt_longer_than_its_blocks_continues_with_its_own_ids() -> None:
    prompts = PromptBuilder(VOCAB)
    a = prompts.prompt(0, request(1200, (7, 9)))
    b = prompts.prompt(1, request(1200, (7, 9)))
    assert len(a) == 1200
    assert a[:1024] == b[:1024]
    assert a[1024:1040] != b[1024:1040]


def test_ids_are_in_the_vocabulary_even_for_long_prompts() -> None:
    prompts = PromptBuilder(50)
    long = prompts.prompt(3, request(70_000))
    assert len(long) == 70_000
    assert min(long) >= 0
    assert max(long) < 50


def test_refuses_what_it_cannot_name() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        PromptBuilder(2)
    with pytest.raises(ValueError, match="out of range"):
        PromptBuilder(10).prompt(1000, request(20))


def test_shared_hash_ids_hit_the_replica_prefix_cache() -> None:
    model = get_model("llama-3.1-8b")
    replica = ReplicaModel(ReplicaConfig(model, get_gpu("h100-sxm"), num_gpu_blocks_override=512))
    prompts = PromptBuilder(model.vocab_size)
    now = 0.0
    cached: list[int] = []
    for index, hashes in enumerate([(0, 1, 2, 3), (0, 1, 2, 9), (5,)]):
        ids = prompts.prompt(index, request(1600 if len(hashes) > 1 else 400, hashes))
        replica.add_request(NewRequest(str(index), ids, 2, ignore_eos=True), now)
        while (plan := replica.plan_step(now)) is not None:
            now += plan.duration
            cached += [o.num_cached_tokens for o in replica.finish_step(plan, now) if o.first_token]
    assert cached == [0, 3 * PREFIX_BLOCK_TOKENS, 0]
