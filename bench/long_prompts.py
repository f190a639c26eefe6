"""Long prompts: the TTFT the gateway adds to ~220 kB chat requests, and its CPU per request.

    .venv/bin/python bench/long_prompts.py   # ~3 min; table + bench/results/long_prompts.{json,png}
    .venv/bin/python bench/long_prompts.py --before ../main   # also the gateway of another tree

Processes on loopback, started by this script (as ``bench/gateway_cost.py`` does):

* a backend that answers at once (raw asyncio + uvloop, four ports standing for four
  replicas; ``/health`` and a vLLM-shaped ``/metrics``): it reads the whole request, then
  writes the answer's head and first SSE event in one write, the rest and ``[DONE]`` in a
  second;
* the gateway as ``gpufleet up`` serves it (``GatewayServer`` on uvloop, probes and the
  200 ms scrape on), once with ``prefix_aware`` (which hashes the prompt) and once with
  ``round_robin`` (which does not: the difference is the hashing and the index, the rest is
  the proxying both do); with ``--before DIR`` the same two again from ``DIR/src`` (another
  checkout: a before/after in one run);
* a closed-loop load generator (raw asyncio HTTP/1.1, one kept-alive connection per client,
  each sending its next request when its previous answer ended).

The prompts are agentic conversations (``--size`` bytes of JSON body, default 220 kB): a
shared ~6 kB system prompt (tool descriptions), then turns of user text (~1.2 kB),
assistant text (~0.8 kB) and tool output (~4 kB) until the body is full; 64 distinct
conversations per size, cycled, so that after the first round every prompt's prefix is
already in ``prefix_aware``'s index (the longest match: its worst case). ``--small`` bodies
(2 kB: the system prompt's first kB and one user turn) give the per-request baseline.

Each phase runs ``--concurrency`` clients for ``--seconds`` (after ``--warmup``) against
one target — the backend directly, or a gateway — and the phases alternate target by
target (the gateways' order turning each round), ``--repeats`` times, so that gateway and
direct see the same machine. TTFT is the time from the request's first byte written to
the answer's first SSE event read; the added TTFT is a gateway's minus direct's (P50 and
P99 of the pooled repeats). CPU per request is the gateway process's user + system time
(``/proc/<pid>/stat``) over the phase / answers.

A closed loop on one saturated gateway core: by Little's law each request waits for the
others' CPU, so the added TTFT at ``c`` clients is about ``c`` × CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from _procs import chunk, free_port, post, process, static_gateway, wait_port

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "long_prompts.json"
MODEL = "llama-3.1-8b"
TICK = os.sysconf("SC_CLK_TCK")
REPLICAS = 4
CONVERSATIONS = 64
GIE_REFERENCE_MS = {20: 154.0, 150: 1100.0}
"""Issue 18's reference: GIE's picker adds this TTFT at 20 and 150 concurrent 220 kB prompts."""

# -- the backend: answers at once ----------------------------------------------------------


def _event(content: str) -> bytes:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


_FIRST = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + chunk(_event("The"))
)
_REST = b"".join(chunk(_event(w)) for w in (" quick", " brown", " fox")) + (
    chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
)
_METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="m"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
)


async def _backend_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            at = lower.find(b"content-length:")
            if at >= 0:
                await reader.readexactly(int(lower[at + 15 : lower.index(b"\r\n", at)]))
            if head.startswith(b"GET /metrics"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(_METRICS), _METRICS)
                )
            elif head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            else:
                writer.write(_FIRST)
                await asyncio.sleep(0)  # the first event leaves on its own
                writer.write(_REST)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve_backend(ports: list[int]) -> None:
    servers = [
        await asyncio.start_server(_backend_conn, "127.0.0.1", port, backlog=1024) for port in ports
    ]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


# -- the gateway, as gpufleet up serves it -------------------------------------------------


def _serve_gateway(port: int, backends: list[int], policy: str) -> None:
    # imported here: a gateway of another tree (``--before``) imports its own gpufleet
    from gpufleet.gateway import GatewayServer  # noqa: PLC0415

    app = static_gateway(MODEL, backends, policy)
    sock = socket.create_server(("127.0.0.1", port), backlog=2048)
    uvloop.run(GatewayServer(app).serve([sock]))


# -- the prompts ---------------------------------------------------------------------------


def _corpus(seed: int = 7, words: int = 200_000) -> str:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _conversation(i: int, size: int, corpus: str) -> list[dict[str, str]]:
    """Chat messages whose JSON body is about ``size`` bytes: a shared system prompt, then
    user / assistant / tool turns (conversation ``i``'s own text)."""
    rng = random.Random(i)

    def text(n: int) -> str:
        at = rng.randrange(len(corpus) - n)
        return corpus[at : at + n]

    system = corpus[: min(6000, size // 2)]  # every conversation's: a shared prefix
    messages = [{"role": "system", "content": system}]
    budget = size - len(system) - 200
    turns = (("user", 1200), ("assistant", 800), ("tool", 4000))
    k = 0
    while budget > 100:
        role, n = turns[k % 3]
        n = min(n, budget - 40)
        messages.append({"role": role, "content": text(n)})
        budget -= n + 40
        k += 1
    return messages


def _request(i: int, port: int, size: int, corpus: str) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": _conversation(i, size, corpus),
            "max_tokens": 4,
            "stream": True,
        }
    ).encode()
    return post(port, body)


# -- the load generator --------------------------------------------------------------------


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes
) -> tuple[int, float, float]:
    """One streamed request on a kept-alive connection: (status, TTFT s, e2e s)."""
    sent = time.perf_counter()
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    first = None
    if b"transfer-encoding: chunked" in head.lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line[:-2].split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            data = await reader.readexactly(size + 2)
            if first is None and b"data: " in data:
                first = time.perf_counter()
    else:
        lower = head.lower()
        at = lower.index(b"content-length:")
        await reader.readexactly(int(lower[at + 15 : lower.index(b"\r\n", at)]))
    end = time.perf_counter()
    return status, (first or end) - sent, end - sent


async def _closed_loop(
    port: int, concurrency: int, size: int, warmup: float, seconds: float
) -> dict[str, Any]:
    corpus = _corpus()
    bodies = [_request(i, port, size, corpus) for i in range(CONVERSATIONS)]
    ttft: list[float] = []
    e2e: list[float] = []
    errors = 0
    statuses: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from = start + warmup
    stop = measure_from + seconds
    marked = asyncio.Event()

    async def mark() -> None:
        await asyncio.sleep(warmup)
        print("measuring", flush=True)  # the driver reads the gateway's CPU now
        marked.set()

    async def client(k: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        i = k
        while loop.time() < stop:
            status, first, whole = await _exchange(reader, writer, bodies[i % len(bodies)])
            i += concurrency
            if not marked.is_set():
                continue
            if status == 200:
                ttft.append(first)
                e2e.append(whole)
            else:
                errors += 1
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        writer.close()

    await asyncio.gather(mark(), *(client(k) for k in range(concurrency)))
    return {
        "requests": len(ttft),
        "errors": errors,
        "statuses": statuses,
        "seconds": seconds,
        "body_bytes": len(bodies[0].split(b"\r\n\r\n", 1)[1]),
        "ttft": ttft,
        "e2e": e2e,
    }


def _loadgen(args: argparse.Namespace) -> None:
    result = uvloop.run(
        _closed_loop(args.port, args.concurrency, args.size, args.warmup, args.seconds)
    )
    args.result.write_text(json.dumps(result))  # (a pipe may be left non-blocking)


# -- the driver ----------------------------------------------------------------------------


def _cpu(pid: int | None) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` so far."""
    if pid is None:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def _phase(
    args: argparse.Namespace, port: int, pid: int | None, size: int, concurrency: int
) -> dict[str, Any]:
    """One closed-loop phase against ``port``; the CPU of ``pid`` over its measured part."""
    argv = [sys.executable, __file__, "--role", "loadgen", "--port", str(port)]
    argv += ["--size", str(size), "--concurrency", str(concurrency)]
    argv += ["--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix="long-prompts-") as scratch:
        path = Path(scratch) / "result.json"
        argv += ["--result", str(path)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as loadgen:
            assert loadgen.stdout is not None
            line = loadgen.stdout.readline()
            assert line.strip() == "measuring", line
            user, system = _cpu(pid)
            if loadgen.wait() != 0:
                raise RuntimeError(f"the load generator failed on port {port}")
            user_after, system_after = _cpu(pid)
        result: dict[str, Any] = json.loads(path.read_text())
    result["cpu_user_s"] = user_after - user
    result["cpu_s"] = user_after - user + system_after - system
    return result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclass
class Row:
    target: str
    size: int
    concurrency: int
    body_bytes: int = 0
    requests: int = 0
    errors: int = 0
    """Answers other than 200 (an overloaded gateway's 5xx): not in the TTFT percentiles."""
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    us_cpu_per_request: float | None = None
    """The gateway's user + system CPU over the phases / their answers."""
    us_user_per_request: float | None = None
    """Of which user (Python); the rest is the kernel's (sockets)."""
    runs_added_p50_ms: list[float] = field(default_factory=list)
    runs_us_cpu_per_request: list[float] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured part of a phase")
    parser.add_argument("--warmup", type=float, default=0.7, help="unmeasured start of a phase")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all targets")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[20, 150])
    parser.add_argument("--size", type=int, default=220_000, help="long body, bytes")
    parser.add_argument("--small", type=int, default=2_000, help="short body, bytes")
    parser.add_argument("--policies", nargs="+", default=["prefix_aware", "round_robin"])
    parser.add_argument("--before", type=Path, help="a checkout whose gateway runs beside")
    parser.add_argument("--role", choices=["driver", "backend", "gateway", "loadgen"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--ports", type=str)
    parser.add_argument("--policy")
    parser.add_argument("--result", type=Path)
    args = parser.parse_args(argv)
    if args.role == "backend":
        uvloop.run(_serve_backend([int(p) for p in args.ports.split(",")]))
        return 0
    if args.role == "gateway":
        _serve_gateway(args.port, [int(p) for p in args.ports.split(",")], args.policy)
        return 0
    if args.role == "loadgen":
        args.concurrency = args.concurrency[0]
        _loadgen(args)
        return 0
    return _drive(args)


def _drive(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=180)
    backends = [free_port() for _ in range(REPLICAS)]
    ports = ",".join(map(str, backends))
    me = [sys.executable, __file__]
    trees = [("", REPO)] + ([("before ", args.before.resolve())] if args.before else [])
    phases: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(
            process([*me, "--role", "backend", "--ports", ports], stdout=subprocess.PIPE)
        )
        assert backend.stdout is not None
        backend.stdout.readline()
        targets: list[tuple[str, int, int | None]] = [("direct", backends[0], None)]
        for label, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree / "src")}
            for policy in args.policies:
                port = free_port()
                gateway = stack.enter_context(
                    process(
                        [*me, "--role", "gateway", "--port", str(port), "--ports", ports,
                         "--policy", policy],
                        env=env,
                    )
                )  # fmt: skip
                wait_port(port)
                targets.append((f"{label}{policy}", port, gateway.pid))
        time.sleep(1.5)  # the first probes and scrapes: every replica routable
        sizes = [args.size, args.small]
        for repeat in range(args.repeats):
            for size in sizes:
                for concurrency in args.concurrency:
                    # direct first, then the gateways in an order that turns each round
                    turn = repeat % (len(targets) - 1)
                    for name, port, pid in [
                        targets[0],
                        *targets[1 + turn :],
                        *targets[1 : 1 + turn],
                    ]:
                        console.print(
                            f"round {repeat + 1}/{args.repeats}: {size // 1000} kB × "
                            f"{concurrency} → {name} …"
                        )
                        result = _phase(args, port, pid, size, concurrency)
                        if result["errors"]:
                            console.print(f"[red]  {result['statuses']} (not counted in TTFT)[/]")
                        phases.setdefault((name, size, concurrency), []).append(result)
    rows = _rows(phases, [t[0] for t in targets], sizes, args.concurrency)
    _table(console, Table, rows)
    _write(args, rows, targets)
    return 0


def _rows(
    phases: dict[tuple[str, int, int], list[dict[str, Any]]],
    names: list[str],
    sizes: list[int],
    concurrencies: list[int],
) -> list[Row]:
    rows = []
    for size in sizes:
        for concurrency in concurrencies:
            direct = phases[("direct", size, concurrency)]
            d_ttft = [t for run in direct for t in run["ttft"]]
            for name in names:
                runs = phases[(name, size, concurrency)]
                ttft = [t for run in runs for t in run["ttft"]]
                errors = sum(run["errors"] for run in runs)
                row = Row(name, size, concurrency, runs[0]["body_bytes"], len(ttft), errors)
                row.ttft_p50_ms, row.ttft_p99_ms = _pct(ttft, 0.5), _pct(ttft, 0.99)
                if name != "direct":
                    row.added_p50_ms = row.ttft_p50_ms - _pct(d_ttft, 0.5)
                    row.added_p99_ms = row.ttft_p99_ms - _pct(d_ttft, 0.99)
                    row.runs_added_p50_ms = [
                        _pct(run["ttft"], 0.5) - _pct(d["ttft"], 0.5)
                        for run, d in zip(runs, direct, strict=True)
                    ]
                    row.runs_us_cpu_per_request = [
                        1e6 * run["cpu_s"] / (run["requests"] + run["errors"]) for run in runs
                    ]
                    spent = sum(r["cpu_s"] for r in runs)
                    row.us_cpu_per_request = 1e6 * spent / (len(ttft) + errors)
                    user = sum(r["cpu_user_s"] for r in runs)
                    row.us_user_per_request = 1e6 * user / (len(ttft) + errors)
                rows.append(row)
    return rows


def _table(console: Any, table_type: Any, rows: list[Row]) -> None:
    table = table_type(title="Long prompts: closed loop, instant backend (TTFT = first SSE event)")
    for column in ("body", "clients", "target", "answers", "TTFT P50 ms", "TTFT P99 ms",
                   "added P50 ms", "added P99 ms", "added P50 per round", "µs CPU/req",
                   "of it user", "per round"):  # fmt: skip
        table.add_column(column, justify="left" if column == "target" else "right")
    for row in rows:
        gateway = row.added_p50_ms is not None
        table.add_row(
            f"{row.body_bytes / 1000:.0f} kB",
            str(row.concurrency),
            row.target,
            f"{row.requests}" + (f" ({row.errors} errors)" if row.errors else ""),
            f"{row.ttft_p50_ms:.1f}",
            f"{row.ttft_p99_ms:.1f}",
            f"{row.added_p50_ms:.1f}" if gateway else "",
            f"{row.added_p99_ms:.1f}" if gateway else "",
            ", ".join(f"{v:.1f}" for v in row.runs_added_p50_ms),
            f"{row.us_cpu_per_request:.0f}" if gateway else "",
            f"{row.us_user_per_request:.0f}" if gateway else "",
            ", ".join(f"{v:.0f}" for v in row.runs_us_cpu_per_request),
        )
    console.print(table)
    for c, ref in GIE_REFERENCE_MS.items():
        console.print(f"issue 18's reference (GIE's picker) at {c} clients: +{ref:.0f} ms TTFT")


def _write(args: argparse.Namespace, rows: list[Row], targets: list[Any]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cpu = {}
    for name, _, pid in targets:
        if pid is None:
            continue
        per = {
            r.size: r.us_cpu_per_request
            for r in rows
            if r.target == name and r.concurrency == args.concurrency[0]
        }
        cpu[name] = {
            "us_per_request_long": per[args.size],
            "us_per_request_small": per[args.small],
            "ratio": (per[args.size] or 0) / (per[args.small] or 1),
        }
    args.out.write_text(
        json.dumps(
            {
                "bench": "long_prompts",
                "command": " ".join(["python", "bench/long_prompts.py", *sys.argv[1:]]),
                "machine": {
                    "python": sys.version.split()[0],
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                },
                "settings": {
                    k: str(v) if isinstance(v, Path) else v
                    for k, v in vars(args).items()
                    if k not in {"role", "port", "ports", "policy", "out"}
                },
                "reference_added_ttft_ms": {"gie_picker": GIE_REFERENCE_MS},
                "cpu_per_request_at_concurrency": args.concurrency[0],
                "cpu": cpu,
                "results": [asdict(r) for r in rows],
            },
            indent=2,
        )
        + "\n"
    )
    _plot(args, rows)


def _plot(args: argparse.Namespace, rows: list[Row]) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(dict.fromkeys(r.target for r in rows if r.added_p50_ms is not None))
    panels = len(args.concurrency)
    fig, axes = plt.subplots(1, panels + 1, figsize=(5 * (panels + 1), 4.6))
    width = 0.8 / max(1, len(names))
    ticks = [i + width * (len(names) - 1) / 2 for i in range(2)]
    labels = [f"{args.size // 1000} kB", f"{args.small // 1000} kB"]
    for ax, concurrency in zip(axes, args.concurrency, strict=False):
        for j, name in enumerate(names):
            got = [r for r in rows if r.target == name and r.concurrency == concurrency]
            xs = [i + j * width for i in range(len(got))]
            ax.bar(xs, [r.added_p50_ms or 0 for r in got], width, label=f"{name} P50")
            ax.scatter(xs, [r.added_p99_ms or 0 for r in got], marker="_", s=300, color="k")
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels)
        ax.set_ylabel("added TTFT, ms (bar P50, tick P99)")
        reference = GIE_REFERENCE_MS.get(concurrency)
        note = f" (issue 18's GIE reference: +{reference:.0f} ms)" if reference else ""
        ax.set_title(f"{concurrency} clients{note}", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[panels]
    for j, name in enumerate(names):
        got = [r for r in rows if r.target == name and r.concurrency == args.concurrency[0]]
        xs = [i + j * width for i in range(len(got))]
        ax.bar(xs, [r.us_cpu_per_request or 0 for r in got], width, label=name)
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels)
    ax.set_ylabel(f"gateway µs CPU / request ({args.concurrency[0]} clients)")
    ax.legend(fontsize=7)
    fig.suptitle("gpufleet gateway vs direct, instant backend, closed loop (bench/long_prompts.py)")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110, metadata={"Software": None})
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
