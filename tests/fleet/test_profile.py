"""``ReplicaProfile``: one value, one command line, read back the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import DEFAULT_MAX_NUM_SEQS, ENGINE_FLAGS, ReplicaProfile

_counts = st.none() | st.integers(1, 1 << 20)
_extra_tokens = st.lists(
    st.one_of(
        st.sampled_from(["--time-scale", "--enforce-eager", "--fault-hang", "-O3", "10"]),
        st.from_regex(r"--x-[a-z]{1,8}(=[0-9]{1,3})?", fullmatch=True),
    ),
    max_size=4,
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
        extra=("--enforce-eager",),
    )
    assert profile.to_argv() == (
        *("--tensor-parallel-size", "2", "--max-num-seqs", "64"),
        *("--max-num-batched-tokens", "4096", "--max-model-len", "2048"),
        *("--gpu-memory-utilization", "0.85", "--num-gpu-blocks-override", "900"),
        *("--block-size", "32", "--no-enable-prefix-caching", "--seed", "7"),
        "--enforce-eager",
    )
    flags = [token for token in profile.to_argv() if token.startswith("--")]
    assert flags[:-1] == [f for f in ENGINE_FLAGS if f != "--enable-prefix-caching"]


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
