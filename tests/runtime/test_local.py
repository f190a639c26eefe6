"""``LocalRuntime`` with real sim engine processes and real HTTP on loopback (no mocks).

Each sim replica starts in about a second; the engines run at a large time scale except in
the drain test, whose request must last long enough to be caught in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.fleet import ReplicaProfile, ReplicaState
from gpufleet.runtime import (
    EngineKind,
    EngineSpec,
    LocalRuntime,
    Phase,
    PoolSpec,
    RuntimeSettings,
    RuntimeSnapshot,
)
from tests.tls_certs import TestCA
from tests.up_process import replica_pids, sim_engine_process

FAST = ReplicaProfile.from_argv(("--time-scale", "100", "--max-model-len", "2048"))
MODEL = "llama-3.1-8b"
SETTINGS = RuntimeSettings(
    backoff_base_s=0.2,
    backoff_max_s=2.0,
    ready_timeout_s=30.0,
    drain_timeout_s=10.0,
    terminate_timeout_s=5.0,
    probe_interval_s=0.05,
)
REPO = Path(__file__).resolve().parents[2]


def sim_pool(name: str = MODEL, replicas: int = 1, *, model: str = MODEL) -> PoolSpec:
    return PoolSpec(name, EngineSpec(model=model, profile=FAST), replicas=replicas)


def runtime(pools: list[PoolSpec], run_dir: Path, **settings: float) -> LocalRuntime:
    return LocalRuntime(
        pools,
        run_dir=run_dir,
        settings=replace(SETTINGS, **settings),
        registry=CollectorRegistry(),
    )


async def wait(
    rt: LocalRuntime, predicate: Callable[[RuntimeSnapshot], bool], timeout: float = 30.0
) -> RuntimeSnapshot:
    async with asyncio.timeout(timeout):
        return await rt.wait_for(predicate)


def count(rt: LocalRuntime, metric: str, **labels: str) -> float:
    value = rt.registry.get_sample_value(f"gpufleet:runtime_{metric}", labels)
    assert value is not None, (metric, labels)
    return value


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def sim_children() -> list[int]:
    """Live processes whose parent is this one and that run a sim engine."""
    return replica_pids(os.getpid(), zombies=False)


@pytest.mark.asyncio
async def test_replicas_start_restart_after_sigkill_and_stop_without_orphans(
    tmp_path: Path,
) -> None:
    seen: list[RuntimeSnapshot] = []
    async with runtime([sim_pool(replicas=2)], tmp_path) as rt:
        rt.subscribe(seen.append)
        snapshot = await wait(rt, RuntimeSnapshot.all_ready)
        names = [r.name for r in snapshot.ready(MODEL)]
        assert names == ["llama-3.1-8b-0", "llama-3.1-8b-1"]
        async with httpx.AsyncClient(trust_env=False) as http:
            for replica in snapshot.replicas:
                assert replica.url is not None
                assert (await http.get(replica.url + "/health")).status_code == 200
                models = (await http.get(replica.url + "/v1/models")).json()
                assert [m["id"] for m in models["data"]] == [MODEL]
        first_pids = [r.pid for r in snapshot.replicas]
        assert all(pid is not None and alive(pid) for pid in first_pids)
        assert count(rt, "ready_replicas", pool=MODEL) == 2
        assert count(rt, "replica_start_seconds_count", pool=MODEL) == 2

        victim = snapshot.replicas[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        back = await wait(
            rt,
            lambda s: (
                (r := s.get(victim.name)) is not None
                and r.state is ReplicaState.READY
                and r.pid != victim.pid
            ),
        )
        again = back.get(victim.name)
        assert again is not None
        assert again.restarts == 1
        assert again.last_error is None  # cleared once ready again
        assert back.get(names[0]) == snapshot.replicas[0]  # the other one untouched
        assert count(rt, "replica_restarts_total", pool=MODEL) == 1
        assert count(rt, "replica_crashes_total", pool=MODEL, reason="exited") == 1
        assert count(rt, "replica_starts_total", pool=MODEL) == 3
        history = [r.state for s in seen if (r := s.get(victim.name)) is not None]
        crash = history.index(ReplicaState.FAILED)
        # failed → starting (launched; then its new address appears) → ready: no flapping.
        assert history[crash:] == [
            ReplicaState.FAILED,
            *[ReplicaState.STARTING] * (len(history) - crash - 2),
            ReplicaState.READY,
        ]
        assert len(history) - crash - 2 >= 1
        all_pids = [*first_pids, again.pid]

    assert rt.snapshot.closed
    assert rt.snapshot.replicas == ()
    assert not any(alive(pid) for pid in all_pids if pid is not None)
    assert sim_children() == []
    for pid in first_pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the whole group is gone
    assert count(rt, "replica_stops_total", pool=MODEL, signal="term") == 2
    assert count(rt, "replica_drains_total", pool=MODEL, outcome="drained") == 2
    assert count(rt, "ready_replicas", pool=MODEL) == 0


@pytest.mark.asyncio
async def test_a_replica_that_cannot_start_is_reported_and_retried_without_blocking(
    tmp_path: Path,
) -> None:
    pools = [sim_pool("bad", model="no-such-model"), sim_pool()]
    async with runtime(pools, tmp_path) as rt:
        snapshot = await wait(
            rt,
            lambda s: (
                len(s.ready(MODEL)) == 1
                and (bad := s.get("bad-0")) is not None
                and bad.restarts >= 2
                and bad.state is ReplicaState.FAILED
            ),
        )
        bad = snapshot.get("bad-0")
        assert bad is not None
        assert bad.phase is Phase.CRASHED
        assert bad.last_error is not None
        assert bad.last_error.startswith("exited with status 2 before it was ready")
        assert "error: unknown model 'no-such-model'" in bad.last_error
        assert bad.url is None
        assert count(rt, "replica_crashes_total", pool="bad", reason="failed_to_start") >= 3
        assert count(rt, "ready_replicas", pool="bad") == 0
        assert count(rt, "ready_replicas", pool=MODEL) == 1
        log = (tmp_path / "bad-0.log").read_text()
        assert log.count("--- gpufleet: launch ") >= 3
        assert "--- gpufleet: launch 1: " in log
    assert sim_children() == []


async def _stream(url: str, first_token: asyncio.Event) -> tuple[int, str | None, int, float]:
    """One streamed completion: (events with a token, finish reason, completion tokens, and
    the loop time at which the last token arrived)."""
    body = {
        "model": MODEL,
        "prompt": "drain me",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, finish, usage, last_token_at = 0, None, 0, 0.0
    async with (
        httpx.AsyncClient(trust_env=False, timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"]:
                tokens += 1
                finish = chunk["choices"][0]["finish_reason"] or finish
                last_token_at = asyncio.get_running_loop().time()
                first_token.set()
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return tokens, finish, usage, last_token_at


@pytest.mark.asyncio
async def test_shutdown_drains_an_in_flight_stream_before_stopping(tmp_path: Path) -> None:
    # Real time (time scale 1): 200 decode steps of an 8B model take about 1.6 s.
    pool = PoolSpec(MODEL, EngineSpec(profile=ReplicaProfile(max_model_len=2048)))
    loop = asyncio.get_running_loop()
    phases: list[tuple[Phase | None, float]] = []

    def record(snapshot: RuntimeSnapshot) -> None:
        replica = snapshot.get("llama-3.1-8b-0")
        phase = replica.phase if replica else None
        if not phases or phases[-1][0] != phase:
            phases.append((phase, loop.time()))

    async with asyncio.TaskGroup() as tg:
        async with runtime([pool], tmp_path) as rt:
            snapshot = await wait(rt, RuntimeSnapshot.all_ready)
            (replica,) = snapshot.replicas
            assert replica.url is not None
            rt.subscribe(record)
            first_token = asyncio.Event()
            stream = tg.create_task(_stream(replica.url, first_token))
            await first_token.wait()
            shutdown_at = loop.time()
        stopped_after = loop.time() - shutdown_at
        tokens, finish, usage, last_token_at = await stream
    assert (tokens, finish, usage) == (200, "length", 200)
    assert stopped_after > 0.5  # it waited for the stream
    order = [phase for phase, _ in phases]
    assert order == [Phase.READY, Phase.DRAINING, Phase.STOPPING, Phase.STOPPED, None]
    draining_at, stopping_at = phases[1][1], phases[2][1]
    # Out of routing at once; SIGTERM only after the last token had reached the client.
    assert draining_at - shutdown_at < 0.1
    assert stopping_at > last_token_at
    assert count(rt, "replica_drains_total", pool=MODEL, outcome="drained") == 1
    assert count(rt, "replica_drains_total", pool=MODEL, outcome="drain_timeout") == 0
    assert count(rt, "replica_stops_total", pool=MODEL, signal="term") == 1
    assert replica.pid is not None
    assert not alive(replica.pid)


@pytest.mark.asyncio
async def test_scale_up_then_down_drains_and_stops_only_the_extra_replica(
    tmp_path: Path,
) -> None:
    watched: list[RuntimeSnapshot] = []

    async def follow(rt: LocalRuntime) -> None:
        async for snapshot in rt.watch():
            watched.append(snapshot)

    async with asyncio.TaskGroup() as tg, runtime([sim_pool()], tmp_path) as rt:
        tg.create_task(follow(rt))
        one = await wait(rt, RuntimeSnapshot.all_ready)
        rt.set_desired(MODEL, 2)
        two = await wait(rt, RuntimeSnapshot.all_ready)
        assert [r.name for r in two.ready()] == ["llama-3.1-8b-0", "llama-3.1-8b-1"]
        assert two.replicas[0] == one.replicas[0]
        extra = two.replicas[1]
        assert count(rt, "desired_replicas", pool=MODEL) == 2

        rt.set_desired(MODEL, 1)
        retiring = await wait(rt, lambda s: len(s.ready()) == 1)
        assert retiring.ready()[0].name == "llama-3.1-8b-0"
        leaving = retiring.get(extra.name)
        assert leaving is None or leaving.state in {ReplicaState.DRAINING, ReplicaState.STOPPED}
        after = await wait(rt, lambda s: len(s.replicas) == 1)
        assert after.replicas[0] == one.replicas[0]
        assert extra.pid is not None
        assert not alive(extra.pid)
        assert count(rt, "replica_drains_total", pool=MODEL, outcome="drained") == 1
        assert count(rt, "replica_starts_total", pool=MODEL) == 2
        with pytest.raises(ValueError, match=">= 0"):
            rt.set_desired(MODEL, -1)
        with pytest.raises(KeyError, match="unknown pool"):
            rt.set_desired("nope", 1)
    # The watcher saw every version it was shown in order, and ended with the runtime.
    versions = [s.version for s in watched]
    assert versions == sorted(set(versions))
    assert watched[-1].closed
    assert watched[-1].replicas == ()
    with pytest.raises(RuntimeError, match="stopping"):
        rt.set_desired(MODEL, 1)


@pytest.mark.asyncio
async def test_a_command_that_cannot_be_executed_is_a_crash_retried_with_backoff(
    tmp_path: Path,
) -> None:
    # A vLLM replica where there is no vLLM: the seam builds the command, the spawn fails.
    engine = EngineSpec(model="org/model", kind=EngineKind.VLLM, env={"PATH": str(tmp_path)})
    async with runtime([PoolSpec("v", engine)], tmp_path) as rt:
        snapshot = await wait(
            rt,
            lambda s: (
                (r := s.get("v-0")) is not None
                and r.restarts >= 2
                and r.state is ReplicaState.FAILED
            ),
        )
    failed = snapshot.get("v-0")
    assert failed is not None
    assert failed.last_error is not None
    assert failed.last_error.startswith("could not start: ")
    assert "'vllm'" in failed.last_error
    assert count(rt, "replica_crashes_total", pool="v", reason="spawn_failed") >= 3
    assert (
        "--- gpufleet: launch 1: vllm serve org/model --host 127.0.0.1 --port "
        in (tmp_path / "v-0.log").read_text()
    )


@pytest.mark.asyncio
async def test_external_endpoints_are_probed_not_started_nor_stopped(tmp_path: Path) -> None:
    async with runtime([sim_pool()], tmp_path / "a") as owner:
        (served,) = (await wait(owner, RuntimeSnapshot.all_ready)).replicas
        assert served.url is not None
        engine = EngineSpec(kind=EngineKind.EXTERNAL, endpoints=(served.url, "http://127.0.0.1:9"))
        external = PoolSpec("ext", engine, replicas=2)
        async with runtime([external], tmp_path / "b", ready_timeout_s=0.5) as rt:
            snapshot = await wait(
                rt,
                lambda s: (
                    len(s.ready()) == 1
                    and (r := s.get("ext-1")) is not None
                    and r.state is ReplicaState.FAILED
                ),
            )
            ready, dead = snapshot.replicas
            assert (ready.name, ready.url, ready.pid, ready.log) == (
                "ext-0",
                served.url,
                None,
                None,
            )
            assert dead.last_error == "http://127.0.0.1:9 not healthy within 0.5 s"
            assert count(rt, "replica_crashes_total", pool="ext", reason="start_timeout") >= 1
            # a preemption notice: not ours to kill (its provider takes it), none unknown
            assert rt.reclaim("ext-0", 0.0) is False
            with pytest.raises(ValueError, match="no replica nope"):
                rt.reclaim("nope", 0.0)
        assert served.pid is not None
        assert alive(served.pid)  # someone else's replica: drained from routing, not stopped
        assert owner.snapshot.replicas == (served,)


def _owner(run_dir: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.owner", str(run_dir), *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_dead(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still alive: {pids}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda sig: sig.name)
def test_a_signal_to_the_owner_drains_and_stops_every_replica(
    tmp_path: Path, sig: signal.Signals
) -> None:
    owner = _owner(tmp_path)
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 1
        assert alive(pids[0])
        owner.send_signal(sig)
        out, err = owner.communicate(timeout=30)
    finally:
        owner.kill()
    assert owner.returncode == 0, err
    assert out.strip() == f"stopped by {sig.name}"
    assert not alive(pids[0])


def test_the_runtime_drains_after_a_uvicorn_server_inside_it_has_stopped(
    tmp_path: Path,
) -> None:
    """uvicorn's ``serve`` takes SIGINT/SIGTERM while it runs and raises it again on exit."""
    owner = _owner(tmp_path, "--uvicorn")
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline())
        owner.send_signal(signal.SIGTERM)
        out, err = owner.communicate(timeout=30)
    finally:
        owner.kill()
    assert owner.returncode == 0, err
    assert out.splitlines() == ["uvicorn stopped", "stopped by SIGTERM"]
    assert not alive(pids[0])
    log = (tmp_path / "llama-3.1-8b-0.log").read_text()
    assert "Shutting down" in log  # SIGTERM after the drain, not SIGKILL


def test_replicas_die_with_a_killed_owner(tmp_path: Path) -> None:
    owner = _owner(tmp_path)
    try:
        assert owner.stdout is not None
        pids = json.loads(owner.stdout.readline())
        owner.kill()  # SIGKILL: no cleanup runs in the owner
        owner.communicate(timeout=10)
        _wait_dead(pids, timeout=10)  # PR_SET_PDEATHSIG
    finally:
        owner.kill()


@pytest.mark.asyncio
async def test_scale_retires_the_named_replica_and_standbys_are_promoted_then_refilled(
    tmp_path: Path,
) -> None:
    pool = replace(sim_pool(replicas=2), standby=1, promote_delay_s=0.3)
    async with runtime([pool], tmp_path) as rt:
        first = await wait(rt, RuntimeSnapshot.all_ready)
        # the standby runs and is ready, but is not among the replicas that take traffic
        assert [r.name for r in first.ready()] == [f"{MODEL}-0", f"{MODEL}-1"]
        assert [(r.name, r.state) for r in first.standbys()] == [(f"{MODEL}-2", ReplicaState.READY)]
        assert count(rt, "standby_replicas", pool=MODEL) == 1

        # the caller (the autoscaler) names who leaves: replica 0, not the highest index
        rt.scale(MODEL, 1, remove=[f"{MODEL}-0"])
        leaving = rt.snapshot.get(f"{MODEL}-0")
        assert leaving is not None
        assert leaving.state is ReplicaState.DRAINING  # out of routing at once
        gone = await wait(rt, lambda s: s.get(f"{MODEL}-0") is None)
        assert [r.name for r in gone.ready()] == [f"{MODEL}-1"]
        assert leaving.pid is not None
        assert not alive(leaving.pid)

        # promotion: the standby's process serves after the promote delay, and a new
        # standby (the lowest free index, 0) starts warming in the background
        standby = first.standbys()[0]
        assert rt.promote(MODEL, [standby.name, f"{MODEL}-1"]) == (standby.name,)
        promoted = rt.snapshot.get(standby.name)
        assert promoted is not None
        assert not promoted.standby
        assert promoted.state is ReplicaState.STARTING  # for promote_delay_s
        serving = await wait(rt, lambda s: len(s.ready()) == 2)
        now_ready = serving.get(standby.name)
        assert now_ready is not None
        assert now_ready.pid == standby.pid  # the same process: no restart
        refilled = await wait(rt, RuntimeSnapshot.all_ready)
        assert [r.name for r in refilled.standbys()] == [f"{MODEL}-0"]
        assert rt.desired == {MODEL: 2}
        assert count(rt, "promotions_total", pool=MODEL) == 1

        rt.set_standby(MODEL, 0)
        await wait(rt, lambda s: not s.standbys() and len(s.replicas) == 2)


@pytest.mark.asyncio
async def test_an_https_endpoint_is_probed_with_its_ca_file(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    issued = ca.issue("replica")
    trusted = ssl.create_default_context(cafile=str(ca.cert))
    tls_flags = ("--ssl-certfile", str(issued.cert), "--ssl-keyfile", str(issued.key))
    with sim_engine_process("--time-scale", "100", *tls_flags, verify=trusted) as url:
        assert url.startswith("https://127.0.0.1:")
        with_ca = EngineSpec(kind=EngineKind.EXTERNAL, endpoints=(url,), ca_file=str(ca.cert))
        without = EngineSpec(kind=EngineKind.EXTERNAL, endpoints=(url,))  # the system's CAs
        pools = [PoolSpec("trusted", with_ca, replicas=1), PoolSpec("plain", without, replicas=1)]
        async with runtime(pools, tmp_path / "run", ready_timeout_s=0.5) as rt:
            snapshot = await wait(
                rt,
                lambda s: (
                    len(s.ready("trusted")) == 1
                    and (r := s.get("plain-0")) is not None
                    and r.state is ReplicaState.FAILED
                ),
            )
            assert [r.url for r in snapshot.ready("trusted")] == [url]
