"""``gpufleet up`` over real vLLM replicas of the tiny model, as a user runs it (a subprocess).

Shared by the ``make test-vllm`` tests and ``bench/vllm_gateway_cost.py``. Only in the vLLM
environment (``.venv-vllm``): the replicas are ``python -m vllm.entrypoints.openai.api_server``
children of the ``gpufleet up`` process, on the CPU.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.real_vllm.tiny_model import make_tiny_llama

MODEL = "tiny"
STARTUP_BUDGET_S = 600
"""A replica's startup budget (``startup.timeout``): two vLLM starts share two busy cores."""

# Two replicas on a 2-core box: one OpenMP thread each, no pinning, a small KV cache.
FLEET = """\
gateway: {{host: 127.0.0.1, port: 0, scrape_interval: 0.2}}
models:
  - name: {model}
    model: {path}
    engine: vllm
    replicas: {replicas}
    max_model_len: 1024
    gpu_memory_utilization: 0.9
    prefix_caching: true
    routing: prefix_aware
    startup: {{timeout: {budget}}}
    health: {{active: {{interval: 0.5}}}}
    args: ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "16"]
    env:
      VLLM_CPU_KVCACHE_SPACE: "1"
      VLLM_CPU_OMP_THREADS_BIND: nobind
      OMP_NUM_THREADS: "1"
      HF_HUB_OFFLINE: "1"
      TRANSFORMERS_OFFLINE: "1"
      VLLM_NO_USAGE_STATS: "1"
      DO_NOT_TRACK: "1"
"""


@dataclass
class RunningFleet:
    """A ``gpufleet up`` process serving real vLLM replicas."""

    base: str
    """The gateway's base URL (``/v1`` is the API)."""
    replicas: dict[str, str]
    """Replica name -> its own base URL, as first started."""
    pids: dict[str, int]
    process: subprocess.Popen[bytes]
    log: Path
    run_dir: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def gateway_metric(self, name: str, **labels: str) -> float | None:
        """One sample of the gateway's ``/metrics`` (runtime metrics included)."""
        return sample(httpx.get(self.base + "/metrics", timeout=10).text, name, **labels)


def sample(page: str, name: str, **labels: str) -> float | None:
    """The value of ``name`` with (at least) ``labels`` on a Prometheus page, summed."""
    total, seen = 0.0, False
    for line in page.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


@contextmanager
def vllm_fleet(
    work: Path, replicas: int = 2, *, extra: Callable[[Path], str] | None = None
) -> Iterator[RunningFleet]:
    """Generate the tiny model, start ``gpufleet up`` and wait until it serves; stop it after
    (SIGTERM: the gateway stops, the runtime drains and stops every replica). ``extra``:
    given the tiny model's directory, more YAML for the pool (indented 4, as its fields)."""
    path = make_tiny_llama(work / "tiny-llama")
    fleet = work / "fleet.yaml"
    text = FLEET.format(model=MODEL, path=path, replicas=replicas, budget=STARTUP_BUDGET_S)
    fleet.write_text(text + (extra(path) if extra is not None else ""))
    log, run_dir = work / "up.out", work / "run"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--port", "0",
             "--run-dir", str(run_dir)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_BUDGET_S + 60
        while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpufleet up did not start:\n{_tail(log, run_dir)}")
            time.sleep(0.2)
        text = log.read_text()
        lines = re.findall(r"replica (\S+)\s+(\S+)\s+(http://\S+)\s+pid (\d+)", text)
        if len(lines) != replicas or any(state != "ready" for _, state, _, _ in lines):
            raise RuntimeError(f"not every replica is ready:\n{_tail(log, run_dir)}")
        running = RunningFleet(
            base=found.group(1),
            replicas={name: url for name, _, url, _ in lines},
            pids={name: int(pid) for name, _, _, pid in lines},
            process=process,
            log=log,
            run_dir=run_dir,
        )
        deadline = time.monotonic() + 30
        while httpx.get(running.base + "/ready", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway is not ready 30 s after it listens")
            time.sleep(0.1)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tail(log: Path, run_dir: Path, lines: int = 40) -> str:
    parts = [log.read_text(errors="replace")]
    for replica_log in sorted(run_dir.glob("*.log")):
        text = replica_log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {replica_log.name} ---\n" + "\n".join(text))
    return "\n".join(parts)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
