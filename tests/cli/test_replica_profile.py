"""One replica profile: a fleet-file entry is launched, simulated and deployed with the same
engine flags (docs/design/replica-profile.md).

    fleet entry ──profile(seed)──► ReplicaProfile ──to_argv──► local command line
                                        │                     Kubernetes container args
                                        └──► simulator's ReplicaConfig
                                             == what `gpufleet engine sim` makes of the argv
"""

from __future__ import annotations

import sys
from typing import Any

import typer
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.cli._deploy_cmd import cluster_fleet
from gpufleet.cli._engine_cmd import app as engine_app
from gpufleet.cli._engine_cmd import engine_config
from gpufleet.cli._up_cmd import pool_spec
from gpufleet.config import parse_fleet
from gpufleet.fleet import ENGINE_FLAGS, ReplicaProfile
from gpufleet.runtime import launch_plan
from gpufleet.runtime.kubernetes import GATEWAY, render
from gpufleet.sim import replica_config

SIM_ENGINE = typer.main.get_command(engine_app)
"""``gpufleet engine sim`` as click parses it (its only command)."""

_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "--max-num-seqs": st.integers(1, 1024),
    "--max-num-batched-tokens": st.integers(256, 16384),
    "--max-model-len": st.integers(256, 8192),
    "--gpu-memory-utilization": st.floats(0.5, 0.95),
    "--num-gpu-blocks-override": st.integers(1000, 50000),
    "--block-size": st.sampled_from([8, 16, 32]),
    "--seed": st.integers(-5, 1 << 32),
}
_PASS_THROUGH = {"sim": ("--time-scale", "10"), "vllm": ("--enforce-eager",)}


@st.composite
def entries(draw: st.DrawFn, engine: str = "sim") -> dict[str, Any]:
    """A fleet-file model: the engine fields or not, and engine flags in ``args`` written the
    ways an engine reads them (``--f v``, ``--f=v``, ``--f_with_underscores v``)."""
    entry: dict[str, Any] = {"name": "llama-3.1-8b", "engine": engine, "replicas": 2}
    if engine == "vllm":
        entry["model"] = "meta-llama/Llama-3.1-8B-Instruct"
    entry["tp"] = draw(st.sampled_from([1, 2, 4]))
    entry["prefix_caching"] = draw(st.booleans())
    if draw(st.booleans()):
        entry["gpu_memory_utilization"] = draw(st.floats(0.5, 0.95))
    if draw(st.booleans()):
        entry["max_model_len"] = draw(st.integers(256, 8192))
    groups: list[list[str]] = []
    for flag, values in _VALUES.items():
        if draw(st.booleans()):
            value = str(draw(values))
            form = draw(st.sampled_from(["space", "equals", "underscores"]))
            if form == "equals":
                groups.append([f"{flag}={value}"])
            elif form == "underscores":
                groups.append(["--" + flag[2:].replace("-", "_"), value])
            else:
                groups.append([flag, value])
    if draw(st.booleans()):
        groups.append(
            [draw(st.sampled_from(["--enable-prefix-caching", "--no-enable-prefix-caching"]))]
        )
    if draw(st.booleans()):
        groups.append(list(_PASS_THROUGH[engine]))
    entry["args"] = [token for group in draw(st.permutations(groups)) for token in group]
    return entry


@given(entries(), st.integers(0, 1 << 32))
def test_a_sim_engine_runs_the_replica_the_simulator_models(
    entry: dict[str, Any], seed: int
) -> None:
    model = parse_fleet({"models": [entry]}).models[0]
    profile = model.profile(seed)
    assert ReplicaProfile.from_argv(profile.to_argv()) == profile
    argv = launch_plan(pool_spec(model, seed).replica(1), "127.0.0.1").argv
    assert argv[:5] == (sys.executable, "-m", "gpufleet", "engine", "sim")
    engine = engine_config(SIM_ENGINE.make_context("sim", list(argv[5:])))
    assert engine.replica_config() == replica_config(model, seed)


@given(st.sampled_from(["sim", "vllm"]).flatmap(entries), st.integers(0, 1 << 32))
def test_kubernetes_pods_run_the_local_engine_flags(entry: dict[str, Any], seed: int) -> None:
    data = {"gateway": {"seed": seed}, "models": [entry]}
    fleet = parse_fleet(data)
    pool = pool_spec(fleet.models[0], fleet.gateway.seed)
    local = launch_plan(pool.replica(1), "127.0.0.1", 8123).argv
    deployment = next(
        o
        for o in render(cluster_fleet(fleet, yaml.safe_dump(data)))
        if o["kind"] == "Deployment" and o["metadata"]["name"] != GATEWAY
    )
    pod_args = tuple(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    flags = pool.engine.profile.to_argv()
    assert pod_args[-len(flags) :] == local[-len(flags) :] == flags
    for before in (pod_args[: -len(flags)], local[: -len(flags)]):
        assert not set(before) & set(ENGINE_FLAGS)  # the profile's flags are written once


def test_every_replica_and_pod_of_a_pool_runs_the_fleets_seed() -> None:
    data = {"gateway": {"seed": 5}, "models": [{"name": "llama-3.1-8b", "replicas": 3}]}
    fleet = parse_fleet(data)
    pool = pool_spec(fleet.models[0], fleet.gateway.seed)
    argvs = {launch_plan(pool.replica(i), "127.0.0.1").argv for i in range(3)}
    assert len(argvs) == 1
    assert argvs.pop()[-2:] == ("--seed", "5")
    assert replica_config(fleet.models[0], 5).seed == 5  # simulated replicas: the run's seed
