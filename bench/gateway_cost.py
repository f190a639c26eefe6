"""What the gateway costs: CPU per proxied request and per streamed chunk, beside nginx.

    .venv/bin/python bench/gateway_cost.py [--uvicorn]   # table + bench/results/gateway_cost.json

Four processes on loopback, started by this script:

* a backend that answers at once (raw asyncio + uvloop, four ports standing for four
  replicas; ``/health`` and a vLLM-shaped ``/metrics`` for the prober and the scraper): a
  chat completion of ~300 bytes, or an SSE stream of ``--chunks`` events paced
  ``--chunk-gap`` apart (a decode step), each its own write;
* the gateway as ``gpufleet up`` serves it (``GatewayServer`` on uvloop, lifespan on:
  health probes and the 200 ms metrics scrape run), ``prefix_aware`` over the four ports;
  with ``--uvicorn`` also the same gateway under uvicorn (uvloop, httptools,
  ``SERVER_OPTIONS``), a second process measured the same way;
* nginx from Debian (one worker, keep-alive upstreams, ``proxy_buffering off``) over the
  same four ports, round robin — skipped, and said so, when ``nginx`` is not installed;
* the load generator (raw asyncio HTTP/1.1 over keep-alive connections).

Prompts are chat messages of ~4 kB (a shared 2 kB system prompt and a 2 kB user turn: 8
prefix blocks, ~1k tokens). CPU is read from ``/proc/<pid>/stat`` (utime + stime; nginx:
master and worker) around each phase:

1. **request**: closed loop, ``--concurrency`` connections of non-streaming requests for
   ``--seconds``: CPU per request, and the rate (the gateway's saturation rate here: its
   process at 100 % of one core);
2. **chunk**: closed loop of streams: (CPU − requests × CPU per request) / events, the
   marginal cost of one more chunk, and CPU / events all in;
3. **latency**: open loop at half of the gateway's saturation rate, straight to the
   backend, through the gateway, through nginx: P50/P99, and the added latency.

All four share the machine's cores, so the rates are this machine's, not the gateway's
alone; CPU per request is the gateway's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from rich.console import Console
from rich.table import Table

from _procs import chunk, free_port, post, process, static_gateway, wait_port
from gpufleet.gateway import (
    SERVER_OPTIONS,
    GatewayServer,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "gateway_cost.json"
MODEL = "llama-3.1-8b"
TICK = os.sysconf("SC_CLK_TCK")
REPLICAS = 4

# -- the backend: answers at once ----------------------------------------------------------

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "the quick brown fox " * 4},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 16, "total_tokens": 1016},
    }
).encode()
_EVENT = (
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": " fox"}, "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)
_METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="m"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
)


def _head(status: int, length: int | None, content_type: bytes) -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n%s\r\n\r\n" % (status, content_type, size)


async def _backend_conn(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunks: int, gap: float
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            at = lower.find(b"content-length:")
            body = b""
            if at >= 0:
                length = int(lower[at + 15 : lower.index(b"\r\n", at)])
                body = await reader.readexactly(length)
            if head.startswith(b"GET /metrics"):
                writer.write(_head(200, len(_METRICS), b"text/plain") + _METRICS)
            elif head.startswith(b"GET"):
                writer.write(_head(200, 0, b"application/json"))
            elif b'"stream": true' in body or b'"stream":true' in body:
                writer.write(_head(200, None, b"text/event-stream"))
                for _ in range(chunks):
                    await asyncio.sleep(gap)
                    writer.write(chunk(_EVENT))
                writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                writer.write(_head(200, len(_COMPLETION), b"application/json") + _COMPLETION)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve_backend(ports: list[int], chunks: int, gap: float) -> None:
    servers = [
        await asyncio.start_server(
            lambda r, w: _backend_conn(r, w, chunks, gap), "127.0.0.1", port, backlog=1024
        )
        for port in ports
    ]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


# -- the gateway, as gpufleet up serves it -------------------------------------------------


def _serve_gateway(port: int, backends: list[int], policy: str, server: str) -> None:
    app = static_gateway(MODEL, backends, policy)
    if server == "uvicorn":  # as gpufleet up served it before: uvloop, httptools, SERVER_OPTIONS
        uvicorn.run(
            app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", **SERVER_OPTIONS
        )
        return
    # as gpufleet up serves it: the gateway's own server on uvloop
    sock = socket.create_server(("127.0.0.1", port), backlog=2048)
    uvloop.run(GatewayServer(app).serve([sock]))


# -- the load generator --------------------------------------------------------------------

_SYSTEM = "You are a helpful assistant. " * 70  # ~2 kB, shared by every request


def _request(i: int, port: int, stream: bool) -> bytes:
    rng = random.Random(i)
    user = " ".join(f"w{rng.randrange(10**6)}" for _ in range(260))[:2000]
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": user},
            ],
            "max_tokens": 16,
            "stream": stream,
        }
    ).encode()
    return post(port, body)


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes
) -> tuple[int, int]:
    """One request on a kept-alive connection: (status, SSE events received)."""
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    events = 0
    if b"transfer-encoding: chunked" in lower:
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line[:-2].split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            events += (await reader.readexactly(size + 2)).count(b"data: {")
    else:
        at = lower.index(b"content-length:")
        await reader.readexactly(int(lower[at + 15 : lower.index(b"\r\n", at)]))
    return status, events


async def _closed_loop(port: int, concurrency: int, seconds: float, stream: bool) -> dict[str, Any]:
    bodies = [_request(i, port, stream) for i in range(256)]
    done = errors = events = 0
    stop = time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal done, errors, events
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        while time.monotonic() < stop:
            status, got = await _exchange(reader, writer, bodies[i % len(bodies)])
            i += concurrency
            done += 1
            events += got
            errors += status != 200
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return {
        "requests": done,
        "errors": errors,
        "events": events,
        "seconds": time.monotonic() - started,
    }


async def _open_loop(port: int, rate: float, seconds: float) -> dict[str, Any]:
    bodies = [_request(i, port, False) for i in range(256)]
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        nonlocal errors
        conn = idle.pop() if idle else await asyncio.open_connection("127.0.0.1", port)
        sent = time.perf_counter()
        status, _ = await _exchange(*conn, bodies[i % len(bodies)])
        latencies.append(time.perf_counter() - sent)
        errors += status != 200
        idle.append(conn)

    # warm the connections first
    for _ in range(16):
        idle.append(await asyncio.open_connection("127.0.0.1", port))
    start = loop.time()
    tasks = []
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    for _, writer in idle:
        writer.close()
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
    }


def _loadgen(args: argparse.Namespace) -> None:
    if args.mode == "open":
        result = uvloop.run(_open_loop(args.port, args.rate, args.seconds))
    else:
        result = uvloop.run(
            _closed_loop(args.port, args.concurrency, args.seconds, args.mode == "stream")
        )
    print(json.dumps(result), flush=True)


# -- the driver ----------------------------------------------------------------------------


def _cpu(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICK


_NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream replicas {{
        {servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def _nginx_pids(master: int) -> list[int]:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [master, *(int(c) for c in children)]


@dataclass
class Measured:
    target: str
    us_per_request: float
    requests_per_s: float
    us_per_chunk_marginal: float
    us_per_chunk_all_in: float
    chunks_per_s: float
    p50_ms: float
    p99_ms: float
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    us_per_request_at_half: float | None = None
    """CPU per request during the open-loop phase (half the gateway's saturation rate)."""


def _run_loadgen(args: argparse.Namespace, port: int, mode: str, **extra: Any) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--role", "loadgen", "--port", str(port), "--mode", mode]
    argv += ["--seconds", str(args.seconds), "--concurrency", str(args.concurrency)]
    if "rate" in extra:
        argv += ["--rate", str(extra["rate"])]
    if "concurrency" in extra:
        argv[-1] = str(extra["concurrency"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _measure(
    args: argparse.Namespace, port: int, pids: list[int]
) -> tuple[float, float, float, float, float]:
    """(µs/request, requests/s, marginal µs/chunk, all-in µs/chunk, chunks/s)."""
    _run_loadgen(args, port, "request", concurrency=8)  # warm up: connections, caches
    before = _cpu(pids)
    plain = _run_loadgen(args, port, "request")
    spent = _cpu(pids) - before
    assert plain["errors"] == 0, plain
    per_request = spent / plain["requests"]
    before = _cpu(pids)
    streams = _run_loadgen(args, port, "stream", concurrency=args.streams)
    spent = _cpu(pids) - before
    assert streams["errors"] == 0, streams
    events = streams["events"]
    marginal = (spent - streams["requests"] * per_request) / events
    return (
        1e6 * per_request,
        plain["requests"] / plain["seconds"],
        1e6 * marginal,
        1e6 * spent / events,
        events / streams["seconds"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop connections")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams")
    parser.add_argument("--chunks", type=int, default=64, help="events per stream")
    parser.add_argument("--chunk-gap", type=float, default=0.002, help="seconds between events")
    parser.add_argument("--policy", default="prefix_aware")
    parser.add_argument(
        "--uvicorn",
        action="store_true",
        help="also measure the gateway under uvicorn (how gpufleet up served it before)",
    )
    parser.add_argument("--server", choices=["own", "uvicorn"], default="own")
    parser.add_argument("--role", choices=["driver", "backend", "gateway", "loadgen"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--ports", type=str)
    parser.add_argument("--mode", choices=["request", "stream", "open"])
    parser.add_argument("--rate", type=float)
    args = parser.parse_args(argv)
    if args.role == "backend":
        uvloop.run(
            _serve_backend([int(p) for p in args.ports.split(",")], args.chunks, args.chunk_gap)
        )
        return 0
    if args.role == "gateway":
        _serve_gateway(args.port, [int(p) for p in args.ports.split(",")], args.policy, args.server)
        return 0
    if args.role == "loadgen":
        _loadgen(args)
        return 0
    return _drive(args)


def _drive(args: argparse.Namespace) -> int:
    console = Console(width=130)
    backends = [free_port() for _ in range(REPLICAS)]
    ports = ",".join(map(str, backends))
    nginx_port = free_port()
    me = [sys.executable, __file__]
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        console.print("[yellow]nginx is not installed: no reference proxy in this run[/]")
    servers = ["own", "uvicorn"] if args.uvicorn else ["own"]
    results: list[Measured] = []
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="gateway-cost-"))
        backend = stack.enter_context(
            process(
                [*me, "--role", "backend", "--ports", ports, "--chunks", str(args.chunks),
                 "--chunk-gap", str(args.chunk_gap)],
                stdout=subprocess.PIPE,
            )
        )  # fmt: skip
        assert backend.stdout is not None
        backend.stdout.readline()
        gateways: list[tuple[str, int, int]] = []
        for server in servers:
            port = free_port()
            gateway = stack.enter_context(
                process(
                    [*me, "--role", "gateway", "--port", str(port), "--ports", ports,
                     "--policy", args.policy, "--server", server]
                )
            )  # fmt: skip
            wait_port(port)
            gateways.append(("gateway" if server == "own" else f"gateway ({server})", port,
                             gateway.pid))  # fmt: skip
        time.sleep(1.5)  # the first probes and scrapes: every replica routable
        for name, port, pid in gateways:
            console.print(f"{name} ({args.policy}) …")
            g = _measure(args, port, [pid])
            results.append(Measured(name, *g, p50_ms=0, p99_ms=0))
        nginx_proc = None
        if nginx is not None:
            conf = Path(scratch) / "nginx.conf"
            upstreams = "\n        ".join(f"server 127.0.0.1:{p};" for p in backends)
            conf.write_text(_NGINX_CONF.format(dir=scratch, servers=upstreams, port=nginx_port))
            nginx_proc = subprocess.Popen([nginx, "-c", str(conf), "-p", scratch])
        try:
            if nginx_proc is not None:
                wait_port(nginx_port)
                console.print("nginx …")
                n = _measure(args, nginx_port, _nginx_pids(nginx_proc.pid))
                results.append(Measured("nginx", *n, p50_ms=0, p99_ms=0))
            rate = results[0].requests_per_s / 2
            console.print(f"latency at {rate:.0f} req/s …")
            targets = [("direct", backends[0], [])]
            targets += [(name, port, [pid]) for name, port, pid in gateways]
            if nginx_proc is not None:
                targets.append(("nginx", nginx_port, _nginx_pids(nginx_proc.pid)))
            latency = {}
            for name, port, pids in targets:
                before = _cpu(pids)
                latency[name] = _run_loadgen(args, port, "open", rate=rate)
                latency[name]["cpu_s"] = _cpu(pids) - before
        finally:
            if nginx_proc is not None:
                nginx_proc.send_signal(signal.SIGQUIT)
                nginx_proc.wait(timeout=10)
    direct = latency["direct"]
    for row in results:
        seen = latency[row.target]
        assert seen["errors"] == 0, seen
        row.p50_ms, row.p99_ms = seen["p50_ms"], seen["p99_ms"]
        row.added_p50_ms = seen["p50_ms"] - direct["p50_ms"]
        row.added_p99_ms = seen["p99_ms"] - direct["p99_ms"]
        row.us_per_request_at_half = 1e6 * seen["cpu_s"] / seen["requests"]

    table = Table(title=f"Gateway cost ({args.policy}; CPU of the proxy process alone)")
    for column in ("proxy", "µs CPU/req (saturated)", "µs CPU/req (half load)", "req/s",
                   "µs CPU/chunk", "all-in µs/chunk", "added P50 ms", "added P99 ms"):  # fmt: skip
        table.add_column(column, justify="left" if column == "proxy" else "right")
    for row in results:
        table.add_row(
            row.target,
            f"{row.us_per_request:.0f}",
            f"{row.us_per_request_at_half:.0f}",
            f"{row.requests_per_s:.0f}",
            f"{row.us_per_chunk_marginal:.1f}",
            f"{row.us_per_chunk_all_in:.1f}",
            f"{row.added_p50_ms:.2f}",
            f"{row.added_p99_ms:.2f}",
        )
    console.print(table)
    console.print(
        f"direct to the backend at {rate:.0f} req/s: P50 {direct['p50_ms']:.2f} ms, "
        f"P99 {direct['p99_ms']:.2f} ms"
    )
    ratios = {}
    n_rows = [r for r in results if r.target == "nginx"]
    if n_rows:
        g_row, n_row = results[0], n_rows[0]
        ratios = {
            "request": g_row.us_per_request / n_row.us_per_request,
            "chunk": g_row.us_per_chunk_marginal / n_row.us_per_chunk_marginal,
        }
        console.print(
            f"gateway / nginx: {ratios['request']:.1f}× per request, "
            f"{ratios['chunk']:.1f}× per chunk"
        )
    else:
        console.print("nginx: not installed (apt-get install nginx), no ratio")
    floors = {"us_per_request": 200.0, "us_per_chunk": 10.0}
    g_row = results[0]
    ok = g_row.us_per_request <= floors["us_per_request"] and (
        g_row.us_per_chunk_marginal <= floors["us_per_chunk"]
    )
    console.print(f"floors (≤ 200 µs/request, ≤ 10 µs/chunk): {'met' if ok else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bench": "gateway_cost",
                "command": " ".join(["python", "bench/gateway_cost.py", *sys.argv[1:]]),
                "machine": {
                    "python": sys.version.split()[0],
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                },
                "settings": {
                    k: getattr(args, k)
                    for k in ("seconds", "concurrency", "streams", "chunks", "chunk_gap", "policy")
                },
                "nginx": nginx is not None,
                "results": [asdict(r) for r in results],
                "latency_rate_per_s": rate,
                "direct": direct,
                "ratio_to_nginx": ratios,
                "floors": floors,
                "floors_met": ok,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
