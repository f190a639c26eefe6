"""``gpufleet up``: the fleet of a fleet file behind the gateway, until Ctrl-C.

With ``runtime: local`` (the default) the runtime starts every replica as a child process;
the gateway (its own HTTP server, ``GatewayServer``, inside the runtime's block) routes to
the ready ones. Ctrl-C or SIGTERM stops the gateway first (its in-flight requests finish),
then the runtime drains and stops every replica.

With ``gateway.tls`` the gateway serves HTTPS (its certificate reloaded when the files
change); ``https://`` endpoints are verified with their model's ``ca_file``. A gateway that
listens on anything but loopback requires API keys unless the file writes ``tenants.auth:
false`` (then it warns).

With ``runtime: kubernetes`` (or ``--runtime kubernetes``: what the rendered gateway
Deployment runs) the gateway is in a cluster: the replicas are the pods of each pool's
Deployment, found through their EndpointSlices and scaled through ``deployments/scale``
(operator mode, docs/kubernetes.md). Stopping the gateway leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Protocol

import typer
from prometheus_client import CollectorRegistry

from gpufleet.cli._errors import user_errors
from gpufleet.config import (
    DEFAULT_FLEET,
    FleetConfig,
    ModelConfig,
    ReclaimConfig,
    RuntimeKind,
    is_loopback,
    load_fleet,
)
from gpufleet.control import Redundancy, Standby
from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.gateway import (
    Gateway,
    GatewayServer,
    Http11ReplicaClient,
    KvHasher,
    ReplicaSource,
    ReplicaTLS,
    ScaleActuator,
    ServerTLS,
    Tenancy,
    Upstream,
    admin_key,
    create_gateway,
    no_spare_message,
    required_replicas,
)
from gpufleet.policy import PrecisePrefixConfig
from gpufleet.runtime import (
    EngineKind,
    EngineSpec,
    LocalRuntime,
    PoolSpec,
    RuntimeSnapshot,
)
from gpufleet.runtime.kubernetes import (
    ApiConfig,
    KubeApi,
    KubernetesRuntime,
    LeaderElection,
    OperatorSettings,
    ReclaimRules,
    ReclaimTaint,
    cluster_pools,
    export_leadership,
    in_cluster_namespace,
)
from gpufleet.store import Store

READY_TIMEOUT_S = 120.0
"""How long to wait for a pool with no startup budget of its own before serving anyway."""
DISCOVERY_TIMEOUT_S = 10.0
"""How long operator mode waits for the first EndpointSlice list before it serves anyway."""


class SnapshotSource(Protocol):
    """A runtime that publishes snapshots: ``LocalRuntime`` or ``KubernetesRuntime``."""

    def subscribe(
        self, listener: Callable[[RuntimeSnapshot], None]
    ) -> Callable[[], None]: ...  # pragma: no cover - a protocol


class RuntimeReplicas(ReplicaSource):
    """The local runtime's snapshots as the gateway's replica list (standbys left out: the
    gateway never routes to them; it learns of them from :class:`RuntimeActuator`)."""

    def __init__(self, runtime: SnapshotSource) -> None:
        self._runtime = runtime

    def subscribe(self, listener: Callable[[Sequence[Upstream]], None]) -> Callable[[], None]:
        def forward(snapshot: RuntimeSnapshot) -> None:
            listener(
                [
                    Upstream(
                        r.name,
                        r.model,
                        r.url,
                        r.state,
                        kv_events=None if r.kv_events is None else r.kv_events[0],
                        kv_replay=None if r.kv_events is None else r.kv_events[1],
                        reclaim_at=r.reclaim_at,
                    )
                    for r in snapshot.replicas
                    if not r.standby
                ]
            )

        return self._runtime.subscribe(forward)


class RuntimeActuator(ScaleActuator):
    """The gateway's autoscaler acting on the local runtime: counts and names only."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self._runtime = runtime

    def scale(self, pool: str, count: int, remove: Sequence[ReplicaId] = ()) -> None:
        self._runtime.scale(pool, count, remove)

    def promote(self, pool: str, replicas: Sequence[ReplicaId]) -> None:
        self._runtime.promote(pool, replicas)

    def standbys(self, pool: str) -> tuple[Standby, ...]:
        return tuple(
            Standby(r.name, ready=r.state is ReplicaState.READY, since=r.since)
            for r in self._runtime.snapshot.standbys(pool)
        )

    def drain(self, pool: str, replica: ReplicaId) -> None:
        """An operator's drain (the console): the pool wants one replica fewer and this one
        goes first, drained as a scale-in drains. Not the pool's last one: that is a
        scale to zero, not a drain."""
        status = self._runtime.snapshot.get(replica)
        if status is None or pool not in (status.model, status.pool) or status.standby:
            raise ValueError(f"{replica} is not a serving replica of {pool}")
        if status.state not in (ReplicaState.READY, ReplicaState.STARTING):
            raise ValueError(f"{replica} is {status.state.value}")
        count = self._runtime.desired[status.pool]
        if count <= 1:
            raise ValueError(f"it is the last replica of {pool}")
        self._runtime.scale(status.pool, count - 1, [replica])

    def preempt(self, pool: str, replica: ReplicaId, notice_s: float) -> bool:
        """A preemption notice, emulated here: the runtime kills the replica's processes
        ``notice_s`` from now, as a provider takes its GPUs, and starts a replacement
        (``False``: an external endpoint, not ours to kill)."""
        status = self._runtime.snapshot.get(replica)
        if status is None or pool not in (status.model, status.pool):
            raise ValueError(f"{replica} is not a replica of {pool}")
        return self._runtime.reclaim(replica, notice_s)


class ClusterActuator(ScaleActuator):
    """The gateway's autoscaler acting on the pools' Deployments (operator mode): a scale-in
    drains the pods it names first. No standbys: a prewarm pool is not built on Kubernetes."""

    def __init__(self, runtime: KubernetesRuntime) -> None:
        self._runtime = runtime

    def scale(self, pool: str, count: int, remove: Sequence[ReplicaId] = ()) -> None:
        self._runtime.scale(pool, count, remove)

    def promote(self, pool: str, replicas: Sequence[ReplicaId]) -> None:
        del pool, replicas  # never asked: standbys() is empty

    def standbys(self, pool: str) -> tuple[Standby, ...]:
        del pool
        return ()


def _routes_on_kv_events(model: ModelConfig) -> bool:
    """A sim pool routed on KV events: its engines publish them (docs/kv-events.md)."""
    return model.engine.value == EngineKind.SIM.value and isinstance(
        model.routing, PrecisePrefixConfig
    )


def prefill_speeds(config: FleetConfig) -> dict[str, float]:
    """The pools' prefill speeds the controller places latency budgets by: the simulator's
    reading of the fleet file (``gpufleet.sim.prefill_speeds``), one function for both."""
    from gpufleet.sim import prefill_speeds as speeds  # noqa: PLC0415 - the perf model

    return speeds(config, config.gateway.seed)


def kv_hasher(config: FleetConfig, seed: int) -> KvHasher | None:
    """``(pool, body) -> engine block hashes`` for the pools ``pool_spec`` makes publish KV
    events (sim engines: their tokenizer, chat template and block size); ``None``: none."""
    from gpufleet.engine.server import SimBlockHasher, SimEngineConfig  # noqa: PLC0415 - ZMQ

    hashers = {
        m.name: SimBlockHasher(
            SimEngineConfig(
                model=m.served_model, gpu=m.gpu, block_size=m.profile(seed).block_size or 16
            )
        )
        for m in config.models
        if _routes_on_kv_events(m)
    }
    if not hashers:
        return None

    def hasher(pool: str, body: dict[str, Any]) -> tuple[int, ...]:
        found = hashers.get(pool)
        return () if found is None else found(body)

    return hasher


def pool_spec(model: ModelConfig, seed: int, traces: str | None = None) -> PoolSpec:
    """The runtime's pool for one model of the fleet file: its engine flags are the model's
    profile on the fleet's ``seed`` (``gateway.seed``); a sim engine sends its spans to
    ``traces`` (``gateway.tracing.endpoint``, docs/tracing.md); a new replica waits
    ``startup.provision`` before its process starts; an autoscaled pool keeps
    ``autoscale.prewarm`` standbys, promoted in ``startup.promote`` seconds."""
    served = model.served_model
    engine = EngineSpec(
        model=served,
        kind=EngineKind(model.engine.value),
        gpu=model.gpu,
        served_model_name=model.name if model.name != served else None,
        profile=model.profile(seed),
        ready_timeout_s=model.startup_timeout,
        env=model.engine_env,
        endpoints=model.endpoints,
        ca_file=model.ca_file,
        kv_events=_routes_on_kv_events(model),
        traces=traces if model.engine.value == EngineKind.SIM.value else None,
    )
    prewarm = model.autoscale.prewarm if model.autoscale is not None else 0
    return PoolSpec(
        model.name,
        engine,
        replicas=model.replica_count,
        start_delay_s=model.startup.provision,
        standby=prewarm,
        promote_delay_s=model.startup.promote,
    )


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
    auth: Annotated[
        bool,
        typer.Option(
            "--auth", help="Require API keys (gpufleet keys create), whatever the file says."
        ),
    ] = False,
    runtime: Annotated[
        RuntimeKind | None,
        typer.Option(help="Where the replicas run (default: the file's `runtime`)."),
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(
            help="Write every control event and decision here (JSON lines; `gpufleet replay`)."
        ),
    ] = None,
) -> None:
    """Start the fleet's replicas and serve the OpenAI-compatible gateway until Ctrl-C.

    Example: gpufleet up --fleet examples/local-sim.yaml --port 8000
    """
    with user_errors():
        config = load_fleet(fleet or DEFAULT_FLEET)
        bind_host = host or config.gateway.host
        bind_port = config.gateway.port if port is None else port
        config, why = secure_default(config, bind_host, auth=auth)
        tracing = config.gateway.tracing
        traces = None if tracing is None else tracing.endpoint
        pools = [pool_spec(m, config.gateway.seed, traces) for m in config.models]
        tls = server_tls(config)
        replica_tls = ReplicaTLS.of(config)
        try:
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            sock = socket.create_server((bind_host, bind_port), family=family)
        except OSError as error:
            raise ValueError(
                f"cannot listen on {bind_host}:{bind_port}: {error.strerror}"
            ) from None
        try:
            recording = None if record is None else record.open("w", encoding="utf-8")
        except OSError as error:
            sock.close()
            raise ValueError(f"cannot write the recording {record}: {error.strerror}") from None
    if why is not None:
        typer.echo(why)
    with contextlib.ExitStack() as stack:
        if recording is not None:
            stack.enter_context(recording)
        serving = Serving(sock, tls, replica_tls, recording)
        if (runtime or config.runtime.kind) is RuntimeKind.KUBERNETES:
            with sock, asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(_serve_in_cluster(config, pools, serving))
            return
        logs = run_dir or Path(tempfile.mkdtemp(prefix="gpufleet-run-"))
        with sock, asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(config, pools, serving, logs))


def secure_default(config: FleetConfig, host: str, *, auth: bool) -> tuple[FleetConfig, str | None]:
    """The fleet as served on ``host``, and a line to show about auth (or ``None``).

    Auth is on with ``--auth`` or ``tenants.auth: true``; on a loopback ``host`` the file's
    value (default off) holds. Elsewhere a gateway others can reach does not serve anyone by
    default: auth goes on, unless the file writes ``tenants.auth: false`` (then a warning).
    """
    if auth or config.tenants.auth:
        return _with_auth(config), None
    if is_loopback(host):
        return config, None
    if config.tenants.auth_written:
        return config, (
            f"warning: auth is off (tenants.auth: false) and the gateway listens on {host}, "
            "not on loopback: anyone who reaches it can use it"
        )
    return _with_auth(config), (
        f"note: the gateway listens on {host}, not on loopback: API keys required "
        "(write `tenants.auth: false` in the fleet file to serve without them)"
    )


def _with_auth(config: FleetConfig) -> FleetConfig:
    if config.tenants.auth:
        return config
    tenants = config.tenants.model_copy(update={"auth": True})
    return config.model_copy(update={"tenants": tenants})


def server_tls(config: FleetConfig) -> ServerTLS | None:
    """The gateway's certificate (``gateway.tls``), loaded once here so that a pair that
    does not load is the command's error, not the first handshake's."""
    tls = config.gateway.tls
    if tls is None:
        return None
    try:
        return ServerTLS(tls.cert_file, tls.key_file, reload_interval=tls.reload_interval)
    except ValueError as error:
        raise ValueError(f"gateway.tls: {error}") from None


@dataclass(frozen=True, slots=True)
class Serving:
    """Where and how the gateway serves: its socket, its certificate, its replicas' CAs."""

    sock: socket.socket
    tls: ServerTLS | None
    replica_tls: ReplicaTLS
    record: IO[str] | None = None
    """Where the control events go (``--record``)."""


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it on Linux
    and macOS): the gateway's hot path costs about a third less CPU on it."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover - Windows
        return None
    return uvloop.new_event_loop


def open_tenancy(config: FleetConfig) -> Tenancy | None:
    """Tenancy when auth is on (keys, quotas, queue, ledger), saying where its state is."""
    if not config.tenants.auth:
        typer.echo("auth: off (anyone may call; `gpufleet up --auth` requires API keys)")
        return None
    store = Store.open(config.tenants.database_url)
    where = store.engine.url.render_as_string(hide_password=True)
    admin = admin_key(config.tenants)
    typer.echo(f"auth: on, keys and usage ledger in {where}")
    if admin is None:
        typer.echo(f"  admin API off: set ${config.tenants.admin_key_env} to enable /admin")
    return Tenancy(config, store, admin_key=admin)


def open_batch_store(config: FleetConfig, tenancy: Tenancy | None) -> Store | None:
    """The store of the Batch API's files and batches: the tenancy's with auth on; with auth
    off the same database, opened for them alone (``gateway.batch.enabled: false``: none)."""
    if not config.gateway.batch.enabled:
        return None
    if tenancy is not None:
        return tenancy.store
    store = Store.open(config.tenants.database_url)
    where = store.engine.url.render_as_string(hide_password=True)
    typer.echo(f"batches: files and batches in {where}")
    return store


def spare_warnings(config: FleetConfig, snapshot: RuntimeSnapshot) -> list[str]:
    """One ``warning:`` line per pool that starts without a spare replica for N+1."""
    lines = []
    for model in config.models:
        check = Redundancy(model.name, len(snapshot.ready(model.name)), required_replicas(model))
        if not check.spare:
            lines.append(f"warning: {no_spare_message(check)}")
    return lines


def _logging() -> None:
    # the gateway's and the runtime's warnings (N+1 lost, a replica restarted) on stderr
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(name)s: %(message)s")
    # every autoscaling decision that acts, as one JSON line with its inputs
    logging.getLogger("gpufleet.autoscale").setLevel(logging.INFO)
    # a certificate reloaded (or not: an error)
    logging.getLogger("gpufleet.tls").setLevel(logging.INFO)


def upstream_client(config: FleetConfig, serving: Serving) -> Http11ReplicaClient:
    """The gateway's client to its replicas, with the fleet file's CA bundles for the
    ``https://`` ones (the app would build one without them)."""
    return Http11ReplicaClient(
        connect=config.gateway.timeouts.connect,
        max_idle=config.gateway.max_connections,
        tls=serving.replica_tls,
    )


async def _serve(
    config: FleetConfig, pools: list[PoolSpec], serving: Serving, run_dir: Path
) -> None:
    _logging()
    registry = CollectorRegistry()
    count = sum(p.replicas for p in pools)
    typer.echo(f"gpufleet up: {len(pools)} model(s), {count} replica(s), logs in {run_dir}")
    async with LocalRuntime(
        pools, run_dir=run_dir, registry=registry, handle_signals=True
    ) as runtime:
        # as long as the longest startup budget of the fleet (a real engine loads for minutes)
        wait = max((p.engine.ready_timeout_s or READY_TIMEOUT_S for p in pools), default=0.0)
        try:
            async with asyncio.timeout(wait):
                snapshot = await runtime.wait_for(RuntimeSnapshot.all_ready)
        except TimeoutError:
            snapshot = runtime.snapshot
            typer.echo(f"warning: not every replica is ready after {wait:g} s")
        for replica in snapshot.replicas:
            where = replica.url or "-"
            pid = f"pid {replica.pid}" if replica.pid is not None else replica.engine.value
            role = "  (standby)" if replica.standby else ""
            typer.echo(
                f"  replica {replica.name:<24} {replica.state.value:<9} {where}  {pid}{role}"
            )
        for line in spare_warnings(config, snapshot):
            typer.echo(line)
        scaled = any(m.autoscale is not None for m in config.models)
        tenancy = open_tenancy(config)
        async with upstream_client(config, serving) as client:
            app = create_gateway(
                config,
                RuntimeReplicas(runtime),
                registry,
                client=client,
                actuator=RuntimeActuator(runtime) if scaled else None,
                tenancy=tenancy,
                record=serving.record,
                actions=RuntimeActuator(runtime),  # operators' drains (the console)
                store=open_batch_store(config, tenancy),
                kv_hasher=kv_hasher(config, config.gateway.seed),
                prefill_s=prefill_speeds(config),
            )
            if serving.record is not None:
                typer.echo(f"recording control events to {serving.record.name}")
            await _serve_gateway(config, app, serving)
        typer.echo("gateway stopped; draining replicas")
        await asyncio.Event().wait()  # the signal the server raises again stops the runtime
    typer.echo("stopped")


async def _serve_gateway(config: FleetConfig, app: Gateway, serving: Serving) -> None:
    """Serve ``app`` on the socket until the server is told to stop (it handles the signals)."""
    server = GatewayServer(app, graceful_timeout=5, tls=serving.tls)
    task = asyncio.create_task(server.serve(sockets=[serving.sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        bound_host, bound_port = serving.sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        base = f"{server.scheme}://{shown}:{bound_port}"
        names = ", ".join(s.name for s in config.served_names())
        banner = [
            f"gateway listening on {base}",
            f"  API      {base}/v1  (models: {names})",
            f"  metrics  {base}/metrics   ready: {base}/ready",
            f"  console  {base}/console",
        ]
        if serving.tls is not None:
            banner.append(
                f"  TLS      {serving.tls.cert_file} (reloaded when it changes, "
                f"every {serving.tls.reload_interval:g} s)"
            )
        banner.append("Ctrl-C to stop")
        # one write: whoever waits for "listening on" (the runtime, tests) sees it all
        typer.echo("\n".join(banner))
    await task


async def _serve_in_cluster(config: FleetConfig, pools: list[PoolSpec], serving: Serving) -> None:
    """Operator mode: the pools' pods, found and scaled through the Kubernetes API."""
    _logging()
    settings = config.runtime
    api_config = ApiConfig(settings.api_server) if settings.api_server else ApiConfig.in_cluster()
    namespace = settings.namespace or in_cluster_namespace() or "default"
    operator = OperatorSettings(
        resync_s=settings.resync_s,
        drain_timeout_s=settings.drain_timeout_s or config.gateway.timeouts.first_byte,
        reclaim=reclaim_rules(settings.reclaim),
    )
    typer.echo(
        f"gpufleet up: {len(pools)} model(s) in namespace {namespace} "
        f"(operator mode, API server {api_config.server})"
    )
    registry = CollectorRegistry()
    scaled = any(m.autoscale is not None for m in config.models)
    async with KubeApi(api_config) as api:
        # several gateway replicas (with Redis): only the holder of the Lease scales
        leader = LeaderElection(api, namespace) if scaled else None
        if leader is not None:
            typer.echo(f"  leader election: lease {leader.settings.name} as {leader.identity}")
        if operator.reclaim is not None:
            cordon = ", and cordons" if operator.reclaim.cordon else ""
            typer.echo(
                f"  nodes: watched for {len(operator.reclaim.taints)} reclaim taint(s){cordon}"
            )
        async with KubernetesRuntime(
            api, namespace, cluster_pools(pools), settings=operator, leader=leader
        ) as runtime:
            export_leadership(runtime, registry)
            await _serve_operator(config, runtime, registry, serving, scaled=scaled)
    typer.echo("stopped")


def reclaim_rules(config: ReclaimConfig) -> ReclaimRules | None:
    """The fleet file's ``runtime.reclaim`` as the operator's rules (``None``: off)."""
    if not config.enabled:
        return None
    taints = tuple(ReclaimTaint(t.key, t.value, t.notice_s) for t in config.taints)
    return ReclaimRules(taints, cordon=config.cordon, notice_s=config.notice_s)


async def _serve_operator(
    config: FleetConfig,
    runtime: KubernetesRuntime,
    registry: CollectorRegistry,
    serving: Serving,
    *,
    scaled: bool,
) -> None:
    """The gateway in front of the discovered pods, until its server is told to stop."""
    try:
        async with asyncio.timeout(DISCOVERY_TIMEOUT_S):
            await runtime.watch.synced.wait()
    except TimeoutError:
        typer.echo(f"warning: no EndpointSlice list after {DISCOVERY_TIMEOUT_S:g} s")
    for replica in runtime.snapshot.replicas:
        typer.echo(f"  replica {replica.name:<40} {replica.state.value:<9} {replica.url}")
    for line in spare_warnings(config, runtime.snapshot):
        typer.echo(line)
    tenancy = open_tenancy(config)
    # the server handles SIGINT/SIGTERM while it serves and raises the signal again once
    # it has shut down: absorb that one, so the block ends normally (pods keep running)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: None)
    try:
        async with upstream_client(config, serving) as client:
            app = create_gateway(
                config,
                RuntimeReplicas(runtime),
                registry,
                client=client,
                actuator=ClusterActuator(runtime) if scaled else None,
                tenancy=tenancy,
                record=serving.record,
                store=open_batch_store(config, tenancy),
                prefill_s=prefill_speeds(config),
            )
            await _serve_gateway(config, app, serving)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
