"""``ReplicaProfile``: one value, one command line, read back the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import (
    DEFAULT_MAX_NUM_SEQS,
    ENGINE_FLAGS,
    LORA_SETTINGS,
    LoraModule,
    ReplicaProfile,
)

_counts = st.none() | st.integers(1, 1 << 20)
_extra_tokens = st.lists(
    st.one_of(
        st.sampled_from(["--time-scale", "--enforce-eager", "--fault-hang", "-O3", "10"]),
        st.from_regex(r"--x-[a-z]{1,8}(=[0-9]{1,3})?", fullmatch=True),
    ),
    max_size=4,
)
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_lora_modules = st.builds(
    LoraModule, name=_text, path=_text, base_model_name=st.none() | _text
) | st.builds(  # the plain spelling, and paths as they usually are
    LoraModule,
    name=st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True),
    path=st.from_regex(r"/adapters/[a-z0-9]{1,8}", fullmatch=True),
)
profiles = st.builds(
    ReplicaProfile,
    tp=st.integers(1, 64),
    max_num_seqs=_counts,
    max_num_batched_tokens=_counts,
    max_model_len=_counts,
    gpu_memory_utilization=st.none() | st.floats(0.0, 1.0, exclude_min=True),
    num_gpu_blocks_override=_counts,
    block_size=_counts,
    enable_prefix_caching=st.none() | st.booleans(),
    seed=st.none() | st.integers(-(1 << 63), 1 << 63),
    enable_lora=st.none() | st.booleans(),
    max_loras=_counts,
    max_lora_rank=_counts,
    max_cpu_loras=_counts,
    lora_modules=st.none() | st.lists(_lora_modules, max_size=3).map(tuple),
    scheduling_policy=st.none() | st.sampled_from(["fcfs", "priority"]),
    extra=_extra_tokens.map(tuple),
)


@given(profiles)
def test_profile_to_argv_to_profile_is_the_identity(profile: ReplicaProfile) -> None:
    assert ReplicaProfile.from_argv(profile.to_argv()) == profile


@given(profiles, profiles)
def test_a_later_command_line_wins_flag_by_flag(
    first: ReplicaProfile, later: ReplicaProfile
) -> None:
    read = ReplicaProfile.from_argv(later.to_argv(), base=first)
    for name, value in later.settings().items():
        assert getattr(read, name) == value
    for name, value in first.settings().items():
        if name not in later.settings():
            assert getattr(read, name) == value
    assert read.extra == first.extra + later.extra


def test_the_command_line_has_a_fixed_order_and_only_what_is_set() -> None:
    assert ReplicaProfile().to_argv() == ("--tensor-parallel-size", "1")
    profile = ReplicaProfile(
        tp=2,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        max_model_len=2048,
        gpu_memory_utilization=0.85,
        num_gpu_blocks_override=900,
        block_size=32,
        enable_prefix_caching=False,
        seed=7,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=64,
        max_cpu_loras=4,
        lora_modules=(LoraModule("sql", "/adapters/sql"),),
        scheduling_policy="priority",
        extra=("--enforce-eager",),
    )
    assert profile.to_argv() == (
        *("--lora-modules", "sql=/adapters/sql"),  # first: the flag after it ends its values
        *("--tensor-parallel-size", "2", "--max-num-seqs", "64"),
        *("--max-num-batched-tokens", "4096", "--max-model-len", "2048"),
        *("--gpu-memory-utilization", "0.85", "--num-gpu-blocks-override", "900"),
        *("--block-size", "32", "--no-enable-prefix-caching", "--seed", "7"),
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"),
        *("--max-cpu-loras", "4", "--scheduling-policy", "priority"),
        "--enforce-eager",
    )
    flags = [token for token in profile.to_argv() if token.startswith("--")]
    switched_on = {"--enable-prefix-caching", "--no-enable-lora"}
    assert flags[:-1] == [f for f in ENGINE_FLAGS if f not in switched_on]


def test_it_reads_a_command_line_as_vllm_does() -> None:
    read = ReplicaProfile.from_argv(
        [
            *("--max-num-seqs", "64", "--max-num-seqs=8"),  # the last one wins
            *("--max_model_len", "2048"),  # vLLM takes _ for -
            *("-tp", "2", "--seed=-3"),
            *("--enable-prefix-caching", "--no-enable-prefix-caching"),
            *("--time-scale", "10", "--enforce-eager"),  # not ours: kept, in order
        ]
    )
    assert read == ReplicaProfile(
        tp=2,
        max_num_seqs=8,
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=-3,
        extra=("--time-scale", "10", "--enforce-eager"),
    )
    assert ReplicaProfile.from_argv(["--tp", "4"]).tp == 4  # the sim engine's old spelling


def test_the_running_batch_cap_is_vllms_default_when_unset() -> None:
    assert ReplicaProfile().running_batch_cap == DEFAULT_MAX_NUM_SEQS == 256
    assert ReplicaProfile(max_num_seqs=8).running_batch_cap == 8
    assert ReplicaProfile(tp=2, seed=1, extra=("--x",)).settings() == {"tp": 2, "seed": 1}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "eight"], "--max-num-seqs 'eight' is not an integer"),
        (["--max-num-seqs", "0"], r"max_num_seqs \(--max-num-seqs\) must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], r"\(--gpu-memory-utilization\) must be in"),
        (["--gpu-memory-utilization", "nan"], "must be in"),
        (["--block-size=x"], "--block-size 'x' is not an integer"),
        (["--seed"], "--seed needs a value"),
        (["--enable-prefix-caching=false"], "takes no value"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy must be fcfs or priority"),
    ],
)
def test_a_bad_value_names_its_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaProfile.from_argv(argv)


def test_an_engine_that_takes_nothing_else_refuses_unknown_flags() -> None:
    assert ReplicaProfile.from_argv(["--seed", "1"], passthrough=False).seed == 1
    with pytest.raises(ValueError, match="no such option: --enforce-eager"):
        ReplicaProfile.from_argv(["--enforce-eager"], passthrough=False)


def test_extra_holds_only_flags_the_profile_does_not_know() -> None:
    with pytest.raises(ValueError, match="profile flag"):
        ReplicaProfile(extra=("--max_num_seqs=8",))
    with pytest.raises(ValueError, match="profile flag"):
        ReplicaProfile(extra=("-tp", "2"))


def test_lora_flags_are_read_as_vllm_reads_them() -> None:
    read = ReplicaProfile.from_argv(
        [
            *("--enable-lora", "--max_loras=4", "--max-lora-rank", "64"),
            *("--lora-modules", "sql=/adapters/sql", ""),  # vLLM skips an empty value
            '{"name": "chat", "path": "/adapters/chat", "base_model_name": "llama"}',
            *("--max-cpu-loras", "8", "--time-scale", "10"),
        ]
    )
    assert read == ReplicaProfile(
        enable_lora=True,
        max_loras=4,
        max_lora_rank=64,
        max_cpu_loras=8,
        lora_modules=(
            LoraModule("sql", "/adapters/sql"),
            LoraModule("chat", "/adapters/chat", base_model_name="llama"),
        ),
        extra=("--time-scale", "10"),
    )
    assert ReplicaProfile.from_argv(["--lora-modules=a=/p", "b=/q"]).extra == ("b=/q",)
    again = ReplicaProfile.from_argv(["--lora-modules", "b=/q"], base=read)
    assert again.lora_modules == (LoraModule("b", "/q"),)  # the last list wins, as in vLLM
    assert ReplicaProfile.from_argv(["--no-enable-lora"]).enable_lora is False
    assert ReplicaProfile(lora_modules=()).lora_modules is None
    assert set(read.settings()) - {"tp"} == LORA_SETTINGS


def test_a_lora_module_takes_the_spelling_that_reads_back() -> None:
    assert LoraModule("a", "/p").to_arg() == "a=/p"
    assert LoraModule("a", "/p,q").to_arg() == '{"name":"a","path":"/p,q"}'
    assert LoraModule("a", "/p", "llama").to_arg() == (
        '{"name":"a","path":"/p","base_model_name":"llama"}'
    )
    assert LoraModule.parse(LoraModule("-a", "/p").to_arg()) == LoraModule("-a", "/p")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules"], "--lora-modules needs a value"),
        (["--lora-modules", "--seed", "1"], "--lora-modules needs a value"),
        (["--lora-modules", "a=b=c"], "one '='"),
        (["--lora-modules", "a"], "neither name=path nor JSON"),
        (["--lora-modules", '{"name": "a"}'], "a JSON adapter has name, path"),
        (["--lora-modules", '{"name": "a", "path": 1}'], "its fields are strings"),
        (["--lora-modules", "=/p"], "needs a name and a path"),
        (["--max-loras", "0"], r"max_loras \(--max-loras\) must be at least 1"),
        (["--max-lora-rank", "x"], "--max-lora-rank 'x' is not an integer"),
        (["--enable-lora=1"], "takes no value"),
    ],
)
def test_a_bad_lora_flag_names_itself(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaProfile.from_argv(argv)


def test_the_scheduling_policy_is_read_written_and_reaches_the_engines_settings() -> None:
    profile = ReplicaProfile.from_argv(["--scheduling_policy=priority", "--max-num-seqs", "8"])
    assert profile.scheduling_policy == "priority"
    assert profile.to_argv()[-2:] == ("--scheduling-policy", "priority")
    assert profile.settings()["scheduling_policy"] == "priority"
    assert "--scheduling-policy" in ENGINE_FLAGS
