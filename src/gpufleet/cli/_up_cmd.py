"""``gpufleet up``: the local fleet of a fleet file behind the gateway, until Ctrl-C.

The runtime starts every replica as a child process; the gateway (its own HTTP server,
``GatewayServer``, inside the runtime's block) routes to the ready ones. Ctrl-C or SIGTERM
stops the gateway first (its in-flight requests finish), then the runtime drains and stops
every replica.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer
from prometheus_client import CollectorRegistry

from gpufleet.cli._errors import user_errors
from gpufleet.config import DEFAULT_FLEET, FleetConfig, ModelConfig, load_fleet
from gpufleet.gateway import (
    GatewayServer,
    ReplicaSource,
    Upstream,
    create_gateway,
    no_spare_message,
    required_replicas,
)
from gpufleet.policy import Redundancy
from gpufleet.runtime import (
    EngineKind,
    EngineSpec,
    LocalRuntime,
    PoolSpec,
    RuntimeSnapshot,
)

READY_TIMEOUT_S = 120.0


class RuntimeReplicas(ReplicaSource):
    """The local runtime's snapshots as the gateway's replica list."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self._runtime = runtime

    def subscribe(self, listener: Callable[[Sequence[Upstream]], None]) -> Callable[[], None]:
        def forward(snapshot: RuntimeSnapshot) -> None:
            listener([Upstream(r.name, r.model, r.url, r.state) for r in snapshot.replicas])

        return self._runtime.subscribe(forward)


def pool_spec(model: ModelConfig) -> PoolSpec:
    """The runtime's pool for one model of the fleet file."""
    served = model.served_model
    engine = EngineSpec(
        model=served,
        kind=EngineKind(model.engine.value),
        gpu=model.gpu,
        tp=model.tp,
        served_model_name=model.name if model.name != served else None,
        args=model.args,
        endpoints=model.endpoints,
    )
    return PoolSpec(model.name, engine, replicas=model.replica_count)


def up(
    fleet: Annotated[
        Path | None,
        typer.Option(help="Fleet file (YAML); default: the packaged local sim fleet."),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Gateway address (default: the file's).")] = None,
    port: Annotated[
        int | None, typer.Option(help="Gateway port, 0 for any free one (default: the file's).")
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="Where replica logs go (default: a new temporary dir).")
    ] = None,
) -> None:
    """Start the fleet's replicas and serve the OpenAI-compatible gateway until Ctrl-C.

    Example: gpufleet up --fleet examples/local-sim.yaml --port 8000
    """
    with user_errors():
        config = load_fleet(fleet or DEFAULT_FLEET)
        pools = [pool_spec(m) for m in config.models]
        bind_host = host or config.gateway.host
        bind_port = config.gateway.port if port is None else port
        try:
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            sock = socket.create_server((bind_host, bind_port), family=family)
        except OSError as error:
            raise ValueError(
                f"cannot listen on {bind_host}:{bind_port}: {error.strerror}"
            ) from None
    logs = run_dir or Path(tempfile.mkdtemp(prefix="gpufleet-run-"))
    with sock, asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(config, pools, sock, logs))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it on Linux
    and macOS): the gateway's hot path costs about a third less CPU on it."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover - Windows
        return None
    return uvloop.new_event_loop


def spare_warnings(config: FleetConfig, snapshot: RuntimeSnapshot) -> list[str]:
    """One ``warning:`` line per pool that starts without a spare replica for N+1."""
    lines = []
    for model in config.models:
        check = Redundancy(model.name, len(snapshot.ready(model.name)), required_replicas(model))
        if not check.spare:
            lines.append(f"warning: {no_spare_message(check)}")
    return lines


async def _serve(
    config: FleetConfig, pools: list[PoolSpec], sock: socket.socket, run_dir: Path
) -> None:
    # the gateway's and the runtime's warnings (N+1 lost, a replica restarted) on stderr
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(name)s: %(message)s")
    registry = CollectorRegistry()
    count = sum(p.replicas for p in pools)
    typer.echo(f"gpufleet up: {len(pools)} model(s), {count} replica(s), logs in {run_dir}")
    async with LocalRuntime(
        pools, run_dir=run_dir, registry=registry, handle_signals=True
    ) as runtime:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                snapshot = await runtime.wait_for(RuntimeSnapshot.all_ready)
        except TimeoutError:
            snapshot = runtime.snapshot
            typer.echo(f"warning: not every replica is ready after {READY_TIMEOUT_S:g} s")
        for replica in snapshot.replicas:
            where = replica.url or "-"
            pid = f"pid {replica.pid}" if replica.pid is not None else replica.engine.value
            typer.echo(f"  replica {replica.name:<24} {replica.state.value:<9} {where}  {pid}")
        for line in spare_warnings(config, snapshot):
            typer.echo(line)
        app = create_gateway(config, RuntimeReplicas(runtime), registry)
        server = GatewayServer(app, graceful_timeout=5)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            bound_host, bound_port = sock.getsockname()[:2]
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            base = f"http://{shown}:{bound_port}"
            typer.echo(f"gateway listening on {base}")
            typer.echo(
                f"  API      {base}/v1  (models: {', '.join(m.name for m in config.models)})"
            )
            typer.echo(f"  metrics  {base}/metrics   ready: {base}/ready")
            typer.echo("Ctrl-C to stop")
        await serving
        typer.echo("gateway stopped; draining replicas")
        await asyncio.Event().wait()  # the signal the server raises again stops the runtime
    typer.echo("stopped")
