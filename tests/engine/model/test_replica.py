"""L0: the replica model's mechanics, driven in virtual time through its public API."""

from __future__ import annotations

import hashlib
import statistics

import pytest

from gpufleet.engine.model import FinishReason, NewRequest, ReplicaModel
from gpufleet.engine.model._tokens import OutputLengths
from gpufleet.perf import BatchShape

from .factories import GPU, MODEL, Driver, make_config, make_replica, request, tokens

# -- prefix caching ---------------------------------------------------------------------------


def test_shared_block_aligned_prefix_is_served_from_the_cache() -> None:
    driver = Driver(make_replica())
    shared = tokens(64, 500)
    driver.add(request("a", shared + tokens(10, 2000), max_tokens=2))
    driver.run()
    driver.add(request("b", shared + tokens(10, 3000), max_tokens=2))
    driver.run()
    assert driver.outputs["a"][0].num_cached_tokens == 0
    assert all(out.num_cached_tokens == 64 for out in driver.outputs["b"])
    stats = driver.model.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (74 + 74, 64)


def test_a_partly_filled_block_is_not_shared() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", tokens(70, 500), max_tokens=1))  # 4 full blocks + 6 tokens
    driver.run()
    driver.add(request("b", tokens(70, 500) + tokens(20, 9000), max_tokens=1))
    driver.run()
    assert driver.outputs["b"][0].num_cached_tokens == 64


def test_an_identical_prompt_recomputes_at_least_its_last_token() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", tokens(64, 500), max_tokens=1))
    driver.run()
    driver.add(request("b", tokens(64, 500), max_tokens=1))
    plan = driver.model.plan_step(driver.now)
    assert plan is not None
    assert plan.num_scheduled_tokens == {"b": 16}  # 3 blocks hit, the last block recomputed
    assert plan.batch == BatchShape.prefill(16, cached=48)


def test_prefix_hits_work_while_the_first_request_still_runs() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", tokens(64, 500), max_tokens=50))
    driver.step()  # a is prefilled and decoding
    driver.add(request("b", (*tokens(64, 500), 7), max_tokens=1))
    driver.run()
    assert driver.outputs["b"][0].num_cached_tokens == 64


def test_least_recently_freed_blocks_are_evicted_first_tail_before_head() -> None:
    # 8 blocks. a's 3 prompt blocks are freed to the tail of the free queue, tail block first.
    driver = Driver(make_replica(num_gpu_blocks_override=8))
    driver.add(request("a", tokens(48, 500), max_tokens=1))
    driver.run()
    driver.add(request("b", tokens(81, 5000), max_tokens=1))  # 6 blocks: 5 never used + a's tail
    driver.step()
    driver.add(request("c", (*tokens(48, 500), 9), max_tokens=1))
    driver.run()
    assert driver.outputs["c"][0].num_cached_tokens == 32  # a's head blocks survived


def test_prefix_caching_can_be_turned_off() -> None:
    driver = Driver(make_replica(enable_prefix_caching=False))
    for rid in ("a", "b"):
        driver.add(request(rid, (*tokens(64, 500), 1), max_tokens=1))
        driver.run()
    assert driver.outputs["b"][0].num_cached_tokens == 0
    assert driver.model.stats().prefix_cache_queries == 0


# -- preemption -------------------------------------------------------------------------------


def test_kv_pressure_preempts_the_newest_request_which_later_completes() -> None:
    # 10 blocks of 16: three requests of 30 + 40 tokens need 5 blocks each at the end.
    model = make_replica(num_gpu_blocks_override=10)
    driver = Driver(model)
    for rid in ("a", "b", "c"):
        driver.add(request(rid, 30, max_tokens=40))
    victims: list[str] = []
    while model.has_work():
        before = model.stats().num_preemptions
        driver.step()
        if model.stats().num_preemptions > before and not victims:
            victims = [rid for rid in ("a", "b", "c") if not model.blocks_of(rid)]
    assert victims == ["c"]
    stats = model.stats()
    assert stats.num_preemptions >= 1
    assert stats.finished["length"] == 3
    for rid in ("a", "b", "c"):
        outs = driver.outputs[rid]
        assert [out.num_output_tokens for out in outs] == list(range(1, 41))
        assert [out.first_token for out in outs].count(True) == 1
        assert outs[-1].finish_reason is FinishReason.LENGTH


def test_a_preempted_request_keeps_its_output_and_first_scheduling_statistics() -> None:
    model = make_replica(num_gpu_blocks_override=10)
    driver = Driver(model)
    for rid in ("a", "b", "c"):
        driver.add(request(rid, 30, max_tokens=40))
    driver.run()
    alone = Driver(make_replica(num_gpu_blocks_override=10))
    alone.add(request("c", 30, max_tokens=40))
    alone.run()
    assert driver.generated("c") == alone.generated("c")  # preemption does not change text
    assert {out.num_cached_tokens for out in driver.outputs["c"]} == {0}
    assert model.stats().prompt_tokens == 90


def test_priority_policy_preempts_the_lowest_priority_request() -> None:
    model = make_replica(num_gpu_blocks_override=10, scheduling_policy="priority")
    driver = Driver(model)
    driver.add(request("low", 30, max_tokens=40, priority=9))
    driver.add(request("high", 30, max_tokens=40, priority=0))
    driver.add(request("mid", 30, max_tokens=40, priority=5))
    victims: list[str] = []
    while model.has_work():
        before = model.stats().num_preemptions
        driver.step()
        if model.stats().num_preemptions > before and not victims:
            victims = [rid for rid in ("low", "high", "mid") if not model.blocks_of(rid)]
    assert victims == ["low"]
    assert all(len(driver.outputs[rid]) == 40 for rid in ("low", "high", "mid"))


def test_a_low_priority_request_that_preempts_itself_does_not_stall_the_step() -> None:
    # 4 blocks of 16. "low" runs first, then "high" fills the cache; low's next token needs a
    # block and low is the lowest priority: it preempts itself, and high still runs.
    model = make_replica(num_gpu_blocks_override=4, scheduling_policy="priority")
    driver = Driver(model)
    driver.add(request("low", 15, max_tokens=20, priority=2))
    driver.step()
    driver.add(request("high", 47, max_tokens=5, priority=0))
    driver.step()
    assert model.stats().kv_cache_usage == 1.0
    driver.step()
    assert driver.plans[-1].num_scheduled_tokens == {"high": 1}
    assert model.stats().num_preemptions == 1
    assert model.blocks_of("low") == ()
    driver.run()
    assert (len(driver.outputs["low"]), len(driver.outputs["high"])) == (20, 5)


# -- chunked prefill --------------------------------------------------------------------------


def test_a_long_prompt_is_chunked_while_running_requests_keep_decoding() -> None:
    model = make_replica(num_gpu_blocks_override=1024, max_num_batched_tokens=2048)
    driver = Driver(model)
    driver.add(request("short", 20, max_tokens=100))
    driver.step()  # short is prefilled
    driver.add(request("long", 5000, max_tokens=5))
    chunks = []
    while not driver.outputs["long"]:
        outs = driver.step()
        assert any(out.request_id == "short" for out in outs)  # decodes continue
        chunks.append(driver.plans[-1].num_scheduled_tokens)
    assert chunks == [
        {"short": 1, "long": 2047},
        {"short": 1, "long": 2047},
        {"short": 1, "long": 906},
    ]
    assert driver.outputs["long"][0].first_token
    # The second chunk: 2047 new tokens over 2047 computed, beside short's second decode
    # (20 prompt tokens + 2 generated in its KV after the step).
    second = driver.plans[-2]
    assert second.batch == BatchShape.prefill(2047, cached=2047) + BatchShape.decode([22])


def test_step_duration_is_the_perf_model_time_of_exactly_that_batch() -> None:
    model = make_replica(num_gpu_blocks_override=1024, max_num_batched_tokens=512)
    driver = Driver(model)
    driver.add(request("a", 20, max_tokens=30))
    driver.step()
    driver.add(request("b", 700, max_tokens=3))
    plan = model.plan_step(driver.now)
    assert plan is not None
    expected = BatchShape.prefill(511, 0) + BatchShape.decode([21])
    assert plan.batch == expected
    assert plan.duration == model.step_time_model.step_time(expected).seconds
    assert plan.timing == model.step_time_model.step_time(expected)
    model.finish_step(plan, driver.now + plan.duration)
    model.set_slowdown(3.0)
    slow = model.plan_step(driver.now)
    assert slow is not None
    assert slow.duration == pytest.approx(3.0 * model.step_time_model.step_time(slow.batch).seconds)
    assert slow.timing == model.step_time_model.step_time(slow.batch)  # before slowdown


def test_max_num_seqs_caps_the_running_batch() -> None:
    model = make_replica(max_num_seqs=2)
    driver = Driver(model)
    for rid in "abcd":
        driver.add(request(rid, 16, max_tokens=4))
    driver.step()
    assert (model.stats().num_running, model.stats().num_waiting) == (2, 2)
    driver.run()
    assert model.stats().finished["length"] == 4


# -- cancellation -----------------------------------------------------------------------------


def test_abort_frees_the_blocks_at_once() -> None:
    model = make_replica()
    driver = Driver(model)
    driver.add(request("a", 100, max_tokens=50))
    driver.step()
    assert model.stats().kv_cache_usage == pytest.approx(7 / 64)
    assert model.abort("a", driver.now)
    assert model.stats().kv_cache_usage == 0.0
    assert model.blocks_of("a") == ()
    assert not model.has_work()
    assert not model.abort("a", driver.now)  # already gone
    assert not model.abort("never", driver.now)
    assert model.stats().finished == {"stop": 0, "length": 0, "abort": 1}


def test_abort_between_plan_and_finish_drops_the_request_output() -> None:
    model = make_replica()
    driver = Driver(model)
    driver.add(request("a", 40, max_tokens=5))
    driver.add(request("b", 40, max_tokens=5))
    plan = model.plan_step(0.0)
    assert plan is not None
    assert model.abort("a", 0.0)
    outs = model.finish_step(plan, plan.duration)
    assert [out.request_id for out in outs] == ["b"]
    model.check_invariants()


def test_abort_of_a_waiting_request() -> None:
    model = make_replica(max_num_seqs=1)
    driver = Driver(model)
    driver.add(request("a", 16, max_tokens=3))
    driver.add(request("b", 16, max_tokens=3))
    driver.step()
    assert model.abort("b", driver.now)
    driver.run()
    assert "b" not in driver.outputs
    assert model.stats().finished == {"stop": 0, "length": 1, "abort": 1}


# -- output lengths and tokens ----------------------------------------------------------------


def test_ignore_eos_generates_exactly_max_tokens() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", 10, max_tokens=37, ignore_eos=True))
    driver.run()
    outs = driver.outputs["a"]
    assert len(outs) == 37
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert all(out.finish_reason is None for out in outs[:-1])
    assert outs[0].first_token
    assert not any(out.first_token for out in outs[1:])


def test_without_ignore_eos_the_length_is_drawn_and_bounded() -> None:
    model = make_replica(num_gpu_blocks_override=4096, max_num_seqs=64)
    driver = Driver(model)
    for i in range(64):
        driver.add(request(f"r{i}", 8, max_tokens=300, ignore_eos=False))
    driver.add(request("tiny", 8, max_tokens=1, ignore_eos=False))
    driver.run()
    lengths = {rid: len(outs) for rid, outs in driver.outputs.items()}
    assert lengths["tiny"] == 1
    assert driver.finish_reason("tiny") == FinishReason.LENGTH
    assert all(1 <= n <= 300 for n in lengths.values())
    for rid, outs in driver.outputs.items():
        expected = FinishReason.LENGTH if len(outs) == (1 if rid == "tiny" else 300) else "stop"
        assert outs[-1].finish_reason == expected
    assert len(set(lengths.values())) > 10  # drawn, not constant


def test_output_lengths_are_log_normal_around_the_median() -> None:
    lengths = OutputLengths(seed=0, median=150.0, sigma=0.9)
    draws = [
        lengths.draw(f"r{i}", 100_000, ignore_eos=False).target_output_tokens for i in range(2000)
    ]
    assert 130 <= statistics.median(draws) <= 170
    assert max(draws) > 1000  # a long right tail
    assert lengths.draw("x", 5, ignore_eos=True).target_output_tokens == 5


def test_token_ids_are_in_the_vocabulary_and_depend_on_the_request_not_its_neighbours() -> None:
    first, second = Driver(make_replica()), Driver(make_replica())
    for rid in ("a", "b", "c"):
        first.add(request(rid, 20, max_tokens=30, ignore_eos=False))
    for rid in ("c", "b"):
        second.add(request(rid, 20, max_tokens=30, ignore_eos=False))
    first.run()
    second.run()
    for rid in ("b", "c"):
        assert first.generated(rid) == second.generated(rid)
    assert all(0 <= t < MODEL.vocab_size for t in first.generated("a"))
    assert first.generated("a") != first.generated("b")


def _fingerprint(seed: int) -> str:
    """Hash of every output and step duration of a mixed run."""
    model = make_replica(num_gpu_blocks_override=40, max_num_batched_tokens=96, seed=seed)
    driver = Driver(model)
    digest = hashlib.sha256()
    for i in range(24):
        prompt = tokens(16 * (i % 3), 700) + tokens(5 + 7 * i, 20 * i)  # some shared prefixes
        driver.add(request(f"r{i}", prompt, max_tokens=60, ignore_eos=i % 2 == 0))
        for out in driver.step():
            digest.update(repr(out).encode())
    driver.run()
    for outs in driver.outputs.values():
        digest.update(repr(outs).encode())
    digest.update(repr([plan.duration for plan in driver.plans]).encode())
    digest.update(repr(model.stats()).encode())
    assert model.stats().num_preemptions > 0  # the run exercises preemption
    return digest.hexdigest()


def test_the_same_seed_gives_the_same_run() -> None:
    assert _fingerprint(seed=3) == _fingerprint(seed=3)
    assert _fingerprint(seed=3) != _fingerprint(seed=4)


# -- scheduling policy ------------------------------------------------------------------------


def test_priority_policy_serves_lower_values_first_then_arrival_order() -> None:
    model = make_replica(max_num_seqs=1, scheduling_policy="priority")
    driver = Driver(model)
    driver.add(request("first", 16, max_tokens=2, priority=5))
    driver.step()  # "first" runs; the rest queue behind it
    driver.add(request("late-low", 16, max_tokens=2, priority=5))
    driver.add(request("urgent", 16, max_tokens=2, priority=0))
    driver.add(request("urgent-2", 16, max_tokens=2, priority=0))
    driver.run()
    order = [plan.num_scheduled_tokens for plan in driver.plans]
    starts = [next(iter(d)) for d in order]
    firsts = list(dict.fromkeys(starts))
    assert firsts == ["first", "urgent", "urgent-2", "late-low"]


def test_fcfs_policy_serves_arrival_order() -> None:
    model = make_replica(max_num_seqs=1)
    driver = Driver(model)
    for rid, priority in (("a", 5), ("b", 0), ("c", 1)):
        driver.add(request(rid, 16, max_tokens=2, priority=priority))
    driver.run()
    firsts = list(dict.fromkeys(next(iter(p.num_scheduled_tokens)) for p in driver.plans))
    assert firsts == ["a", "b", "c"]


# -- configuration and bad input --------------------------------------------------------------


def test_kv_cache_is_sized_by_the_perf_model() -> None:
    model = ReplicaModel(make_config(num_gpu_blocks_override=None))
    assert model.num_gpu_blocks > 10_000  # an 8B model leaves ~50 GB of an H100 for KV
    assert model.max_model_len == MODEL.max_context


def test_max_model_len_defaults_to_what_the_cache_holds() -> None:
    assert make_replica(num_gpu_blocks_override=10).max_model_len == 160
    assert make_replica(max_model_len=500).max_model_len == 500


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_model_len": 2000}, "larger than the 1024 tokens the KV cache can hold"),
        ({"max_model_len": 10**6, "num_gpu_blocks_override": 10**6}, "maximum context length"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be at least 1"),
        ({"tp": 3}, "does not divide"),
        ({"output_len_median": 0.0}, "output_len_median must be > 0"),
    ],
)
def test_bad_configuration_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaModel(make_config(**overrides))


def test_a_model_that_does_not_fit_is_refused() -> None:
    small = GPU.model_copy(update={"memory_gib": 8.0})
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        ReplicaModel(make_config(gpu=small, num_gpu_blocks_override=None))


def test_a_too_long_request_gets_an_openai_style_message() -> None:
    model = make_replica(max_model_len=100)
    with pytest.raises(ValueError, match="maximum context length is 100 tokens") as error:
        model.add_request(request("a", 90, max_tokens=20), 0.0)
    assert str(error.value) == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(90 in the messages, 20 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    model.add_request(request("b", 90, max_tokens=10), 0.0)  # exactly the limit is fine


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (NewRequest("a", (), 5), "prompt is empty"),
        (NewRequest("a", (1, 2), 0), "max_tokens must be at least 1, got 0"),
        (NewRequest("a", (1, -2), 5), "token id -2 is out of vocabulary"),
        (NewRequest("a", (1, 10**7), 5), "token id 10000000 is out of vocabulary"),
    ],
)
def test_bad_requests_are_refused(new: NewRequest, message: str) -> None:
    model = make_replica()
    with pytest.raises(ValueError, match=message):
        model.add_request(new, 0.0)
    assert not model.has_work()


def test_a_request_id_in_use_is_refused_until_it_finishes() -> None:
    model = make_replica()
    driver = Driver(model)
    driver.add(request("a", 10, max_tokens=2))
    with pytest.raises(ValueError, match="'a' is already running or waiting"):
        driver.add(request("a", 10, max_tokens=2))
    driver.run()
    driver.add(request("a", 10, max_tokens=2))  # finished ids may be reused


def test_slowdown_must_be_positive() -> None:
    model = make_replica()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="slowdown factor"):
            model.set_slowdown(bad)
    model.set_slowdown(0.5)
    assert model.slowdown == 0.5


# -- the plan / finish contract ---------------------------------------------------------------


def test_idle_replica_plans_nothing() -> None:
    model = make_replica()
    assert model.plan_step(0.0) is None
    assert not model.has_work()


def test_one_step_in_flight_at_a_time() -> None:
    model = make_replica()
    model.add_request(request("a"), 0.0)
    plan = model.plan_step(0.0)
    assert plan is not None
    with pytest.raises(RuntimeError, match="step 0 is in flight"):
        model.plan_step(0.0)
    model.finish_step(plan, plan.duration)
    with pytest.raises(ValueError, match="step in flight is none"):
        model.finish_step(plan, plan.duration)


def test_requests_added_during_a_step_join_the_next_one() -> None:
    model = make_replica()
    model.add_request(request("a"), 0.0)
    plan = model.plan_step(0.0)
    assert plan is not None
    model.add_request(request("b"), 0.001)
    assert [o.request_id for o in model.finish_step(plan, plan.duration)] == ["a"]
    nxt = model.plan_step(plan.duration)
    assert nxt is not None
    assert set(nxt.num_scheduled_tokens) == {"a", "b"}


def test_stats_count_tokens_and_finishes() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", 10, max_tokens=3))
    driver.add(request("b", 20, max_tokens=4))
    driver.run()
    stats = driver.model.stats()
    assert (stats.prompt_tokens, stats.generation_tokens) == (30, 7)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert (stats.num_gpu_blocks, stats.block_size) == (64, 16)
    assert stats.finished == {"stop": 0, "length": 2, "abort": 0}


# -- pooling (prompt-only) requests -----------------------------------------------------------


def pooling(request_id: str, prompt: tuple[int, ...]) -> NewRequest:
    return NewRequest(request_id, prompt, max_tokens=1, pooling=True)


def test_a_pooling_request_is_one_prefill_and_finishes_with_no_token() -> None:
    model = make_replica(num_gpu_blocks_override=1024, max_num_batched_tokens=512)
    driver = Driver(model)
    driver.add(pooling("e", tokens(700, 100)))
    first = model.plan_step(driver.now)
    assert first is not None
    assert first.batch == BatchShape.prefill(512, 0)  # chunked like any prompt
    driver.now += first.duration
    assert model.finish_step(first, driver.now) == []
    outs = driver.step()
    assert len(outs) == 1
    out = outs[0]
    assert out.new_token_ids == ()
    assert out.finish_reason is FinishReason.STOP
    assert (out.num_prompt_tokens, out.num_output_tokens, out.first_token) == (700, 0, False)
    assert driver.plans[-1].batch == BatchShape.prefill(188, cached=512)
    assert not model.has_work()
    stats = model.stats()
    assert (stats.prompt_tokens, stats.generation_tokens) == (700, 0)
    assert stats.finished == {"stop": 1, "length": 0, "abort": 0}
    assert stats.kv_cache_usage == 0.0
    model.check_invariants()


def test_pooling_requests_share_the_batch_with_decodes() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", 20, max_tokens=5))
    driver.step()
    driver.add(pooling("e", tokens(40, 3000)))
    outs = driver.step()
    assert driver.plans[-1].batch == BatchShape.prefill(40, 0) + BatchShape.decode([21])
    assert {o.request_id: o.new_token_ids == () for o in outs} == {"a": False, "e": True}
    driver.run()
    assert driver.model.stats().generation_tokens == 5


def test_a_pooling_prompt_longer_than_the_context_is_refused() -> None:
    model = make_replica(max_model_len=100)
    with pytest.raises(ValueError, match=r"100 tokens.*101 tokens in the input for embedding"):
        model.add_request(pooling("e", tokens(101)), 0.0)
    model.add_request(pooling("ok", tokens(100)), 0.0)  # no room is kept for output


def test_a_pooling_request_can_be_aborted_mid_prefill() -> None:
    driver = Driver(make_replica(num_gpu_blocks_override=8, max_num_batched_tokens=16))
    driver.add(pooling("e", tokens(100, 500)))
    driver.step()
    assert driver.model.abort("e", driver.now)
    assert driver.model.stats().finished["abort"] == 1
    driver.model.check_invariants()


def test_siblings_added_together_hit_the_first_ones_blocks_in_the_same_step() -> None:
    """``n`` sequences of one prompt: the first one's full blocks are registered when they are
    allocated, so the others are prefilled from the cache in the very step it computes them."""
    driver = Driver(make_replica())
    prompt = tokens(70, 500)  # 4 full blocks + 6 tokens
    for i in range(3):
        driver.add(request(f"s{i}", prompt, max_tokens=2))
    driver.step()
    assert driver.plans[0].num_scheduled_tokens == {"s0": 70, "s1": 6, "s2": 6}
    assert [driver.outputs[f"s{i}"][0].num_cached_tokens for i in range(3)] == [0, 64, 64]


def test_memory_plan_is_the_one_the_kv_cache_was_cut_from() -> None:
    model = make_replica(num_gpu_blocks_override=None, tp=2)
    plan = model.memory_plan()
    assert model.num_gpu_blocks == plan.kv_blocks > 0
    assert plan.weights < make_replica(num_gpu_blocks_override=None).memory_plan().weights
    # an override sizes the cache, not the layout
    overridden = make_replica(num_gpu_blocks_override=10, tp=2)
    assert overridden.num_gpu_blocks == 10
    assert overridden.memory_plan() == plan
