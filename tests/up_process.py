"""``gpufleet up`` as a real child process, for the tests that need the whole command."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx


def start_up(
    fleet: Path | None,
    log: Path,
    *extra: str,
    run_dir: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``gpufleet up --fleet FLEET --port 0 --run-dir RUN_DIR EXTRA…`` with its output in
    ``log`` (``fleet`` ``None``: no ``--fleet``, the default fleet ``make run`` starts);
    return the process and the gateway's base URL once it listens. Its store (the Batch
    API's, with auth off too) is under ``$GPUFLEET_HOME``: ``env``'s, else a folder beside
    ``log``, never the working directory."""
    env = dict(env if env is not None else os.environ)
    if "GPUFLEET_HOME" not in env:
        env["GPUFLEET_HOME"] = str(log.parent / "gpufleet-home")
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpufleet", "up",
             *(() if fleet is None else ("--fleet", str(fleet))), "--port", "0",
             "--run-dir", str(run_dir), *extra],
            stdout=out, stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not (found := re.search(r"listening on (https?://\S+)", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise AssertionError(f"gpufleet up did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process, found.group(1)


def wait_ready(base: str, timeout: float = 10.0, verify: ssl.SSLContext | bool = True) -> None:
    """Until the gateway's ``/ready`` answers 200 (its first health probes answered);
    ``verify``: what an ``https://`` gateway's certificate is checked with."""
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/ready", verify=verify).status_code != 200:
        assert time.monotonic() < deadline, f"{base}/ready is not 200 after {timeout:g} s"
        time.sleep(0.05)


def replica_pids(parent: int, *, zombies: bool = True) -> list[int]:
    """The engine processes ``gpufleet up`` (``parent``) runs now, oldest first; with
    ``zombies``, also those dead and not yet reaped (a kill's victim until the runtime
    sees it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and b"engine" in cmdline and (zombies or state != "Z"):
            pids.append(int(entry.name))
    return sorted(pids)


def wait_routable(base: str, model: str, count: int, timeout: float = 60.0) -> None:
    """Until the gateway's ``/ready`` counts ``count`` routable replicas of ``model``."""
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/ready").json()["routable"][model] != count:
        assert time.monotonic() < deadline, f"not {count} routable replicas after {timeout} s"
        time.sleep(0.02)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Kill the process if it still runs (a test's ``finally``)."""
    if process.poll() is None:
        process.kill()
        process.wait()


@contextmanager
def sim_engine_process(
    *args: str, timeout: float = 30.0, verify: ssl.SSLContext | bool = True
) -> Iterator[str]:
    """``gpufleet engine sim --port 0 ARGS…`` as a child process (it can crash, or be
    crashed, without taking the test along); yields its URL once ``/health`` answers
    (``verify``: what an ``https://`` one's certificate is checked with)."""
    with sim_engine_child(*args, timeout=timeout, verify=verify) as (url, _):
        yield url


@contextmanager
def sim_engine_child(
    *args: str, timeout: float = 30.0, verify: ssl.SSLContext | bool = True
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """:func:`sim_engine_process`, with the process too (a test that kills it)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpufleet", "engine", "sim", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        url = process.stdout.readline().split("listening on ")[1].split(",")[0].strip()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "replica process did not start"
            time.sleep(0.05)
        yield url, process
    finally:
        process.kill()
        process.communicate()
