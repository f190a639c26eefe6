"""``LocalRuntime``: replicas as child processes on loopback, kept as desired by a reconciler.

The async shell around ``reconcile`` (STYLE 14): it observes processes (launched, healthy,
exited, idle while draining), records those facts as ``ProcessState`` values, calls the pure
reconciler with the loop's clock and executes the actions it returns. Every background task
(the reconcile loop, one watcher per process, readiness probes, drain polls) lives in one
``asyncio.TaskGroup`` owned by the runtime's ``async with`` block (STYLE 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Final, Self

import httpx
from prometheus_client import CollectorRegistry

from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.runtime._drain import in_flight, wait_idle
from gpufleet.runtime._launch import (
    die_with_parent,
    find_kv_events,
    find_url,
    launch_plan,
    log_tail,
    reserve_port,
    signal_group,
)
from gpufleet.runtime._members import PoolMembers
from gpufleet.runtime._metrics import CrashReason, RuntimeMetrics
from gpufleet.runtime._reconcile import (
    LIVE,
    Abort,
    Action,
    Create,
    Drain,
    Forget,
    Kill,
    Launch,
    Phase,
    ProcessState,
    ResetBackoff,
    RuntimeSettings,
    Terminate,
    backoff_delay,
    ready_timeout,
    reconcile,
)
from gpufleet.runtime._snapshot import FLEET_STATE, ReplicaStatus, RuntimeSnapshot
from gpufleet.runtime._spec import (
    SPAWNED,
    EngineKind,
    PoolSpec,
    ReplicaSpec,
    check_count,
)

logger = logging.getLogger("gpufleet.runtime")

Listener = Callable[[RuntimeSnapshot], None]

_DEFAULT_SETTINGS: Final = RuntimeSettings()

_SHUTDOWN_MARGIN_S = 5.0
"""Extra wait, beyond drain + terminate timeouts, before a shutdown kills what is left."""


class _Replica:
    """The shell's record of one replica: its observed state and its current process."""

    def __init__(self, spec: ReplicaSpec, now: float, log: Path | None) -> None:
        self.state = ProcessState(spec, Phase.PENDING, now)
        self.log = log
        self.log_offset = 0
        self.process: asyncio.subprocess.Process | None = None
        self.probe: asyncio.Task[None] | None = None
        self.url: str | None = None
        self.kv_events: tuple[str, str] | None = None
        self.launches = 0
        self.restarts = 0
        self.launched_at = now
        self.failure: CrashReason | None = None
        """Set when the runtime kills a start itself; names the crash when the exit comes."""
        self.last_error: str | None = None

    @property
    def spec(self) -> ReplicaSpec:
        return self.state.spec


class LocalRuntime:
    """Runs pools of engine replicas as local child processes; see docs/design/local-runtime.md.

    ::

        async with LocalRuntime(pools, run_dir=Path("run")) as runtime:
            snapshot = await runtime.wait_for(RuntimeSnapshot.all_ready)
            [r.url for r in snapshot.ready("llama-3.1-8b")]
            runtime.subscribe(on_change)        # called with every new snapshot
            runtime.set_desired("llama-3.1-8b", 3)
        # leaving the block drains every replica, stops it, and leaves no process behind

    ``handle_signals=True`` (for the process's owner, e.g. the CLI): the first SIGINT or
    SIGTERM cancels the task inside the block, which then drains and stops everything as
    above (the cancellation is absorbed: the block simply ends); a second one kills every
    replica at once. A handler installed inside the block (uvicorn's ``Server.serve``) takes
    precedence while it is installed; uvicorn raises the signal again when it has shut down,
    and the runtime then drains.
    """

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        *,
        run_dir: Path | str,
        settings: RuntimeSettings = _DEFAULT_SETTINGS,
        registry: CollectorRegistry | None = None,
        host: str = "127.0.0.1",
        handle_signals: bool = False,
    ) -> None:
        self._pools: dict[str, PoolSpec] = {}
        for pool in pools:
            if pool.name in self._pools:
                raise ValueError(f"pool {pool.name!r} is given twice")
            self._pools[pool.name] = pool
        self._members = {
            name: PoolMembers.first(pool.replicas, pool.standby)
            for name, pool in self._pools.items()
        }
        self._promoting: dict[ReplicaId, float] = {}
        """Promoted standbys shown STARTING until this loop time (the pool's promote delay)."""
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.host = host
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = RuntimeMetrics(self.registry)
        for name, pool in self._pools.items():
            self._metrics.add_pool(name)
            self._metrics.desired.labels(name).set(pool.replicas)
        self._handle_signals = handle_signals
        self._replicas: dict[str, _Replica] = {}
        self._listeners: list[Listener] = []
        self._snapshot = RuntimeSnapshot(
            0, (), MappingProxyType(self._counts()), MappingProxyType(self._standby_targets())
        )
        self._published = asyncio.Event()
        self._wake = asyncio.Event()
        self._all_stopped = asyncio.Event()
        self._entered = False
        self._closing = False
        self._closed = False
        self._stack = contextlib.AsyncExitStack()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._http: httpx.AsyncClient | None = None
        self._https: dict[str, httpx.AsyncClient] = {}
        """Per ``ca_file`` of an external pool: the client that probes its endpoints."""
        self._supervisor: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._signals_seen = 0
        self._cancelled_owner = False
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._own_handlers: dict[signal.Signals, Any] = {}
        self.stop_signal: signal.Signals | None = None
        """The signal that stopped the runtime (``handle_signals``), if one did."""

    # -- what the gateway and the CLI read ------------------------------------------------

    @property
    def snapshot(self) -> RuntimeSnapshot:
        """The current state of every replica (frozen; replaced on every change)."""
        return self._snapshot

    @property
    def desired(self) -> dict[str, int]:
        """Wanted serving replica count per pool (standbys not counted)."""
        return self._counts()

    def _counts(self) -> dict[str, int]:
        return {name: len(m.serving) for name, m in self._members.items()}

    def _standby_targets(self) -> dict[str, int]:
        return {name: m.standby_target for name, m in self._members.items()}

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(snapshot)`` on every change, now included; returns the unsubscriber.

        Listeners run synchronously in the runtime's task, before it acts on the change: a
        replica is shown DRAINING to every listener before its drain starts to wait, so a
        router that drops it there never sends it new work. A listener must not block.
        """
        self._listeners.append(listener)
        listener(self._snapshot)
        return lambda: self._listeners.remove(listener)

    async def watch(self) -> AsyncIterator[RuntimeSnapshot]:
        """The current snapshot, then each newer one (a slow reader skips to the newest);
        ends after the runtime has stopped."""
        seen = -1
        while True:
            published, snapshot = self._published, self._snapshot
            if snapshot.version != seen:
                seen = snapshot.version
                yield snapshot
            elif snapshot.closed:
                return
            else:
                await published.wait()

    async def wait_for(self, predicate: Callable[[RuntimeSnapshot], bool]) -> RuntimeSnapshot:
        """The first snapshot, current or future, that satisfies ``predicate``.

        Bound it with ``asyncio.timeout``; raises ``RuntimeError`` if the runtime stops first.
        """
        while True:
            published, snapshot = self._published, self._snapshot
            if predicate(snapshot):
                return snapshot
            if snapshot.closed:
                raise RuntimeError("the runtime stopped before the condition held")
            await published.wait()

    # -- what the autoscaler calls ---------------------------------------------------------

    def set_desired(self, pool: str, count: int) -> None:
        """Scale ``pool`` to ``count`` serving replicas; scale-in retires the highest indices.

        New replicas start (after the pool's start delay); removed ones are drained, then
        stopped. Returns at once; watch the snapshot for the outcome.
        """
        self.scale(pool, count)

    def scale(self, pool: str, count: int, remove: Sequence[str] = ()) -> None:
        """Scale ``pool`` to ``count`` serving replicas, retiring the ``remove``d ones first.

        ``remove`` names replicas of the pool (the autoscaler's least loaded); a name that is
        not serving (already draining, unknown) is ignored, so repeating a call is harmless.
        Past them, the highest indices go; new replicas take the lowest free index. A removed
        replica is published DRAINING at once (no new requests), stopped when its in-flight
        requests have finished or ``drain_timeout_s`` passed.
        """
        members = self._pool_members(pool)
        check_count(self._pools[pool], count)
        members.scale(count, self._indices(pool, remove), self._taken(pool))
        self._metrics.desired.labels(pool).set(count)
        self._changed()

    def reclaim(self, name: str, after: float) -> bool:
        """The provider takes replica ``name``'s GPUs ``after`` seconds from now (a spot
        preemption, emulated): its process group is killed then, as a node that vanishes,
        and a replacement starts as after any crash (reason ``preempted``). ``False``: an
        external endpoint, which someone else runs (its provider takes it). ``ValueError``
        when it is unknown or has no process now."""
        replica = self._replicas.get(name)
        if replica is None:
            raise ValueError(f"no replica {name}")
        if replica.spec.engine.kind is EngineKind.EXTERNAL:
            return False
        if replica.process is None:
            raise ValueError(f"{name} has no process to take")
        self._spawn(self._reclaim(replica, replica.launches, after), f"reclaim-{name}")
        return True

    async def _reclaim(self, replica: _Replica, incarnation: int, after: float) -> None:
        await asyncio.sleep(after)
        process = replica.process
        if replica.launches != incarnation or process is None:
            return  # restarted or stopped meanwhile: the notice was the old process's
        replica.failure = "preempted"
        signal_group(process.pid, signal.SIGKILL)

    def set_standby(self, pool: str, count: int) -> None:
        """Keep ``count`` prewarmed standbys in ``pool``: started and ready, never routed
        (``ReplicaStatus.standby``), refilled in the background after each promotion."""
        members = self._pool_members(pool)
        if count < 0:
            raise ValueError(f"pool {pool!r}: standby count must be >= 0, got {count}")
        members.standby_target = count
        members.refill(self._taken(pool), self._warming_first(pool))
        self._changed()

    def promote(self, pool: str, names: Sequence[str]) -> tuple[ReplicaId, ...]:
        """Move these standbys of ``pool`` into service (others are ignored) and start their
        replacements; returns the names moved. A promoted standby keeps its process: it is
        shown STARTING for the pool's ``promote_delay_s``, then READY (at once if it was
        still warming up: then it is READY when its engine is)."""
        members = self._pool_members(pool)
        moved = members.promote(self._indices(pool, names))
        due = asyncio.get_running_loop().time() + self._pools[pool].promote_delay_s
        spec = self._pools[pool]
        promoted = tuple(spec.replica(i).name for i in moved)
        for name in promoted:
            if spec.promote_delay_s > 0:
                self._promoting[name] = due
                asyncio.get_running_loop().call_at(due, self._changed)
            self._metrics.promotions.labels(pool).inc()
        members.refill(self._taken(pool), self._warming_first(pool))
        self._metrics.desired.labels(pool).set(len(members.serving))
        self._changed()
        return promoted

    def _pool_members(self, pool: str) -> PoolMembers:
        if pool not in self._pools:
            raise KeyError(f"unknown pool {pool!r}; pools: {', '.join(self._pools)}")
        if self._closing:
            raise RuntimeError("the runtime is stopping")
        return self._members[pool]

    def _indices(self, pool: str, names: Sequence[str]) -> list[int]:
        """The indices of the named replicas of ``pool`` that the runtime knows."""
        spec = self._pools[pool]
        known: dict[str, int] = {
            r.spec.name: r.spec.index for r in self._replicas.values() if r.spec.pool == pool
        }
        known.update({spec.replica(i).name: i for i in self._members[pool].wanted()})
        return [known[n] for n in names if n in known]

    def _taken(self, pool: str) -> set[int]:
        """Indices of every replica record of ``pool`` (draining and stopping ones too)."""
        return {r.spec.index for r in self._replicas.values() if r.spec.pool == pool}

    def _warming_first(self, pool: str) -> list[int]:
        """The pool's standbys, those not ready yet first (retired first if too many)."""
        standby = self._members[pool].standby
        records = {r.spec.index: r for r in self._replicas.values() if r.spec.pool == pool}
        return sorted(
            standby,
            key=lambda i: (i in records and records[i].state.phase is Phase.READY, -i),
        )

    # -- lifespan -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a LocalRuntime runs once")
        self._entered = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._http = await self._stack.enter_async_context(
                httpx.AsyncClient(trust_env=False, timeout=self.settings.probe_timeout_s)
            )
            for ca_file in {p.engine.ca_file for p in self._pools.values()} - {None}:
                assert ca_file is not None
                self._https[ca_file] = await self._stack.enter_async_context(
                    httpx.AsyncClient(
                        trust_env=False,
                        timeout=self.settings.probe_timeout_s,
                        verify=ssl.create_default_context(cafile=ca_file),
                    )
                )
            self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        except BaseException:
            await self._stack.aclose()
            raise
        self._supervisor = self._spawn(self._supervise(), "gpufleet-runtime-reconcile")
        if self._handle_signals:
            self._install_signal_handlers()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            await self._shutdown()
        finally:
            self._restore_signal_handlers()
            for task in list(self._tasks):
                task.cancel()
            self._closed = True
            self._publish()
            await self._stack.aclose()
        # The cancellation our own signal handler caused ends here: the block just ends.
        return (
            exc_type is asyncio.CancelledError
            and self._cancelled_owner
            and self._owner is not None
            and self._owner.uncancel() == 0
        )

    async def _shutdown(self) -> None:
        """Drain and stop everything through the reconciler; kill what is left after that."""
        self._closing = True
        for pool, members in self._members.items():
            members.serving.clear()
            members.standby.clear()
            members.standby_target = 0
            self._metrics.desired.labels(pool).set(0)
        self._changed()
        budget = (
            self.settings.drain_timeout_s + self.settings.terminate_timeout_s + _SHUTDOWN_MARGIN_S
        )
        try:
            if self._supervisor is not None and not self._supervisor.done():
                try:
                    async with asyncio.timeout(budget):
                        await self._all_stopped.wait()
                except TimeoutError:
                    logger.error("replicas still running %.0f s into shutdown: killing", budget)
        finally:
            await self._kill_remaining()

    async def _kill_remaining(self) -> None:
        """SIGKILL every process group still alive (all first, then wait), and reap them."""
        processes = self._kill_all()
        for process in processes:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await process.wait()

    def _kill_all(self) -> list[asyncio.subprocess.Process]:
        """SIGKILL every live process group now; their exits are recorded as kills."""
        killed = []
        now = asyncio.get_running_loop().time()
        for replica in self._replicas.values():
            if replica.process is not None:
                signal_group(replica.process.pid, signal.SIGKILL)
                replica.state = replace(replica.state, phase=Phase.STOPPING, since=now, killed=True)
                killed.append(replica.process)
        return killed

    # -- the reconcile loop ---------------------------------------------------------------

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            observed = {name: r.state for name, r in self._replicas.items()}
            desired = [
                pool.replica(i)
                for name, pool in self._pools.items()
                for i in self._members[name].wanted()
            ]
            plan = reconcile(loop.time(), desired, observed, self.settings)
            for action in plan.actions:
                await self._apply(action)
            self._publish()
            if self._closing and not self._replicas:
                self._all_stopped.set()
                return
            if plan.actions:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(plan.requeue_after):
                    await self._wake.wait()

    async def _apply(self, action: Action) -> None:
        now = asyncio.get_running_loop().time()
        if isinstance(action, Create):
            spec = action.spec
            log = None if spec.engine.kind not in SPAWNED else self.run_dir / f"{spec.name}.log"
            self._replicas[spec.name] = _Replica(spec, now, log)
            return
        replica = self._replicas[action.name]
        match action:
            case Launch(restart=restart):
                await self._launch(replica, restart=restart)
            case Abort():
                self._abort(replica)
            case Drain():
                replica.state = replace(replica.state, phase=Phase.DRAINING, since=now, idle=False)
                self._publish()  # listeners stop routing to it before the poll starts
                self._spawn(self._wait_idle(replica, replica.launches), f"drain-{action.name}")
            case Terminate(reason=reason):
                if replica.state.phase is Phase.DRAINING:
                    self._metrics.drains.labels(replica.spec.pool, reason).inc()
                self._terminate(replica, now)
            case Kill():
                if replica.process is not None:
                    signal_group(replica.process.pid, signal.SIGKILL)
                replica.state = replace(replica.state, killed=True)
            case ResetBackoff():
                replica.state = replace(replica.state, crashes=0)
            case Forget():
                del self._replicas[action.name]

    # -- actions on one replica -----------------------------------------------------------

    async def _launch(self, replica: _Replica, *, restart: bool) -> None:
        spec, loop = replica.spec, asyncio.get_running_loop()
        pool = spec.pool
        replica.launches += 1
        replica.url, replica.failure, replica.kv_events = None, None, None
        self._metrics.starts.labels(pool).inc()
        if restart:
            replica.restarts += 1
            self._metrics.restarts.labels(pool).inc()
        incarnation = replica.launches
        if spec.engine.kind is EngineKind.EXTERNAL:
            replica.url = spec.endpoint
            self._starting(replica, loop.time())
            replica.probe = self._spawn(self._probe(replica, incarnation), f"probe-{spec.name}")
            return
        port = reserve_port(self.host) if spec.engine.kind is EngineKind.VLLM else None
        plan = launch_plan(spec, self.host, port)
        assert replica.log is not None
        with replica.log.open("ab") as log:
            log.write(f"--- gpufleet: launch {incarnation}: {shlex.join(plan.argv)}\n".encode())
            log.flush()
            replica.log_offset = log.tell()
            try:
                process = await asyncio.create_subprocess_exec(
                    *plan.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env={**os.environ, **plan.env},
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
            except OSError as error:
                log.write(f"cannot execute {plan.argv[0]!r}: {error}\n".encode())
                log.flush()
                self._crashed(replica, "spawn_failed", f"could not start: {error}")
                return
        replica.process, replica.url = process, plan.url
        self._starting(replica, loop.time())
        self._spawn(self._watch(replica, incarnation, process), f"watch-{spec.name}")

    def _starting(self, replica: _Replica, now: float) -> None:
        replica.launched_at = now
        replica.state = ProcessState(replica.spec, Phase.STARTING, now, replica.state.crashes)
        logger.info("replica %s launched (start %d)", replica.spec.name, replica.launches)

    def _abort(self, replica: _Replica) -> None:
        """A start overran ``ready_timeout_s``: kill it; its exit will count as a crash."""
        replica.failure = "start_timeout"
        if replica.process is not None:
            signal_group(replica.process.pid, signal.SIGKILL)
            replica.state = replace(replica.state, killed=True)
            return
        if replica.probe is not None:
            replica.probe.cancel()
        timeout = ready_timeout(replica.spec, self.settings)
        self._crashed(replica, "start_timeout", f"{replica.url} not healthy within {timeout:g} s")

    def _terminate(self, replica: _Replica, now: float) -> None:
        if replica.process is not None:
            signal_group(replica.process.pid, signal.SIGTERM)
            replica.state = replace(replica.state, phase=Phase.STOPPING, since=now)
            return
        if replica.probe is not None:  # an external endpoint: nothing to stop
            replica.probe.cancel()
        replica.state = replace(replica.state, phase=Phase.STOPPED, since=now)

    def _crashed(self, replica: _Replica, reason: CrashReason, what: str) -> None:
        spec, now = replica.spec, asyncio.get_running_loop().time()
        crashes = replica.state.crashes + 1
        tail = (
            log_tail(replica.log, replica.log_offset, self.settings.log_tail_lines)
            if replica.log is not None
            else ""
        )
        shown = f"\nlast lines of {replica.log}:\n{tail}" if tail else ""
        replica.last_error = what + shown
        replica.state = ProcessState(spec, Phase.CRASHED, now, crashes)
        self._metrics.crashes.labels(spec.pool, reason).inc()
        if not self._closing:
            logger.warning(
                "replica %s %s (%s, crash %d in a row; next start in %.1f s)%s",
                spec.name,
                what,
                reason,
                crashes,
                backoff_delay(crashes, self.settings),
                shown,
            )
        self._changed()

    # -- observers (one set per launch) ---------------------------------------------------

    async def _watch(
        self, replica: _Replica, incarnation: int, process: asyncio.subprocess.Process
    ) -> None:
        """Probe the process until it is ready, and record its exit."""
        probe = self._spawn(self._probe(replica, incarnation), f"probe-{replica.spec.name}")
        try:
            code = await process.wait()
        finally:
            probe.cancel()
        # Anything the engine forked that outlived it goes too (the group id stays reserved
        # while members remain, so this reaches no one else).
        signal_group(process.pid, signal.SIGKILL)
        self._exited(replica, code)

    def _exited(self, replica: _Replica, code: int) -> None:
        state, now = replica.state, asyncio.get_running_loop().time()
        pool = replica.spec.pool
        replica.process = None
        ended = _ended(code)
        if state.phase is Phase.STOPPING:
            self._metrics.stops.labels(pool, "kill" if state.killed else "term").inc()
            replica.state = replace(state, phase=Phase.STOPPED, since=now, killed=False)
            self._changed()
        elif state.phase is Phase.DRAINING:  # it was being retired anyway
            self._metrics.crashes.labels(pool, "exited").inc()
            replica.last_error = f"{ended} while draining"
            replica.state = replace(state, phase=Phase.STOPPED, since=now)
            self._changed()
        elif state.phase is Phase.READY:
            self._crashed(replica, replica.failure or "exited", ended)
        else:
            what = f"{ended} before it was ready"
            if replica.failure == "start_timeout":
                timeout = ready_timeout(replica.spec, self.settings)
                what = f"was not ready within {timeout:g} s and {ended}"
            self._crashed(replica, replica.failure or "failed_to_start", what)

    def _client(self, spec: ReplicaSpec) -> httpx.AsyncClient:
        """What probes ``spec``'s replica: with its pool's CA bundle, if it names one."""
        ca_file = spec.engine.ca_file
        client = self._http if ca_file is None else self._https[ca_file]
        assert client is not None
        return client

    async def _probe(self, replica: _Replica, incarnation: int) -> None:
        """Find the address (sim: its log) and poll ``/health`` until it answers 200."""
        http = self._client(replica.spec)
        interval = self.settings.probe_interval_s
        while replica.url is None:
            assert replica.log is not None
            with contextlib.suppress(OSError):
                replica.url = find_url(replica.log, replica.log_offset)
                if replica.url is not None and replica.spec.engine.kv_events:
                    replica.kv_events = find_kv_events(replica.log, replica.log_offset)
            if replica.url is None:
                await asyncio.sleep(interval)
        self._publish()
        url = replica.url
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url + "/health")).status_code == 200:
                    break
            await asyncio.sleep(interval)
        state = replica.state
        if replica.launches != incarnation or state.phase is not Phase.STARTING or state.killed:
            return
        now = asyncio.get_running_loop().time()
        self._metrics.start_seconds.labels(replica.spec.pool).observe(now - replica.launched_at)
        replica.state = replace(state, phase=Phase.READY, since=now)
        replica.last_error = None
        logger.info("replica %s ready at %s", replica.spec.name, url)
        self._changed()

    async def _wait_idle(self, replica: _Replica, incarnation: int) -> None:
        """Poll a draining replica's ``/metrics`` until nothing runs or waits there."""
        http, url = self._client(replica.spec), replica.url
        assert url is not None

        async def read() -> int | None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                return in_flight((await http.get(url + "/metrics")).text)
            return None

        def draining() -> bool:
            return replica.state.phase is Phase.DRAINING and replica.launches == incarnation

        if await wait_idle(read, self.settings.probe_interval_s, draining=draining):
            replica.state = replace(replica.state, idle=True)
            self._changed()

    # -- plumbing -------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        assert self._tg is not None
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _changed(self) -> None:
        self._wake.set()
        self._publish()

    def _publish(self) -> None:
        order = {name: i for i, name in enumerate(self._pools)}
        now = asyncio.get_running_loop().time()
        for name in [n for n, due in self._promoting.items() if due <= now]:
            del self._promoting[name]
        replicas = tuple(
            self._status(r)
            for r in sorted(
                self._replicas.values(), key=lambda r: (order[r.spec.pool], r.spec.index)
            )
        )
        old, counts, standby = self._snapshot, self._counts(), self._standby_targets()
        if (replicas, dict(old.desired), dict(old.standby), old.closed) == (
            old.replicas,
            counts,
            standby,
            self._closed,
        ):
            return
        new = RuntimeSnapshot(
            old.version + 1,
            replicas,
            MappingProxyType(counts),
            MappingProxyType(standby),
            self._closed,
        )
        self._snapshot = new
        for pool in self._pools:
            self._metrics.ready.labels(pool).set(len(new.ready(pool)))
            ready_standbys = sum(1 for r in new.standbys(pool) if r.phase is Phase.READY)
            self._metrics.standby.labels(pool).set(ready_standbys)
        for listener in list(self._listeners):
            try:
                listener(new)
            except Exception:
                logger.exception("runtime listener %r failed", listener)
        published, self._published = self._published, asyncio.Event()
        published.set()

    def _status(self, replica: _Replica) -> ReplicaStatus:
        spec, phase = replica.spec, replica.state.phase
        state = FLEET_STATE[phase]
        members = self._members[spec.pool]
        if state is ReplicaState.READY and spec.name in self._promoting:
            state = ReplicaState.STARTING  # promoted; joins after the promote delay
        elif phase is Phase.READY and spec.index not in members.serving | members.standby:
            # retired: shown draining from the call that retired it, before the reconciler
            # runs, so the gateway sends it nothing new
            state = ReplicaState.DRAINING
        return ReplicaStatus(
            name=spec.name,
            pool=spec.pool,
            model=spec.engine.served_name,
            engine=spec.engine.kind,
            state=state,
            phase=phase,
            standby=spec.index in members.standby,
            since=replica.state.since,
            url=replica.url if phase in LIVE else None,
            kv_events=replica.kv_events if phase in LIVE else None,
            pid=replica.process.pid if replica.process is not None else None,
            restarts=replica.restarts,
            log=replica.log,
            last_error=replica.last_error,
        )

    # -- signals --------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        self._owner = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._own_handlers[sig] = signal.getsignal(sig)

    def _restore_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig, previous in self._previous_handlers.items():
            loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)
        self._previous_handlers.clear()

    def _on_signal(self, sig: signal.Signals) -> None:
        if signal.getsignal(sig) is not self._own_handlers[sig]:
            # A handler installed inside our block owns the signal now (uvicorn's ``serve``
            # does this); it shuts its own part down and raises the signal again after
            # restoring ours, and that is the delivery we act on.
            return
        self._signals_seen += 1
        if self._signals_seen == 1:
            self.stop_signal = sig
            if not self._closing and self._owner is not None:
                logger.warning(
                    "%s: draining and stopping every replica (again to kill them now)", sig.name
                )
                self._cancelled_owner = True
                self._owner.cancel()
            return
        logger.warning("%s: killing every replica now", sig.name)
        self._kill_all()
        self._changed()


def _ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
