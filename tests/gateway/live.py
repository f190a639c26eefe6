"""``gpufleet up`` wiring in the test's own event loop: the local runtime with real sim engine
processes, the gateway (uvicorn on 127.0.0.1:0) with its autoscaler acting on the runtime.

The same pieces ``gpufleet up`` assembles (``pool_spec``, ``RuntimeReplicas``,
``RuntimeActuator``), so the tests see the gateway's and the runtime's state directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import uvicorn
from prometheus_client import CollectorRegistry

from gpufleet.cli._up_cmd import (
    RuntimeActuator,
    RuntimeReplicas,
    kv_hasher,
    pool_spec,
    prefill_speeds,
)
from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.gateway import SERVER_OPTIONS, Gateway, Tenancy, create_gateway
from gpufleet.runtime import LocalRuntime, RuntimeSettings, RuntimeSnapshot

SETTINGS = RuntimeSettings(
    ready_timeout_s=30.0, drain_timeout_s=20.0, terminate_timeout_s=5.0, probe_interval_s=0.05
)


@dataclass
class LiveFleet:
    url: str
    runtime: LocalRuntime
    gateway: Gateway
    registry: CollectorRegistry

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def until(
        self, predicate: Callable[[RuntimeSnapshot], bool], timeout: float = 30.0
    ) -> RuntimeSnapshot:
        async with asyncio.timeout(timeout):
            return await self.runtime.wait_for(predicate)

    async def routable(self, model: str, count: int, timeout: float = 30.0) -> None:
        """Wait until the gateway routes to exactly ``count`` replicas of ``model``."""
        async with asyncio.timeout(timeout):
            while len(self.gateway.control.pools[model].routable()) != count:
                await asyncio.sleep(0.02)


def fleet_file(data: dict[str, Any]) -> FleetConfig:
    return parse_fleet(data, source="test fleet")


@contextlib.asynccontextmanager
async def live_fleet(
    config: FleetConfig,
    run_dir: Path,
    *,
    tenancy: Tenancy | None = None,
    record: IO[str] | None = None,
) -> AsyncIterator[LiveFleet]:
    """``tenancy``: auth and admission on; ``record``: the gateway's control events go there."""
    registry = CollectorRegistry()
    pools = [pool_spec(m, config.gateway.seed) for m in config.models]
    async with LocalRuntime(pools, run_dir=run_dir, settings=SETTINGS, registry=registry) as rt:
        async with asyncio.timeout(60):
            await rt.wait_for(RuntimeSnapshot.all_ready)
        app = create_gateway(
            config,
            RuntimeReplicas(rt),
            registry,
            actuator=RuntimeActuator(rt),
            tenancy=tenancy,
            record=record,
            actions=RuntimeActuator(rt),
            kv_hasher=kv_hasher(config, config.gateway.seed),
            prefill_s=prefill_speeds(config),
        )
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, **SERVER_OPTIONS)
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                assert not serving.done(), "the gateway did not start"
                await asyncio.sleep(0.01)
            port = sock.getsockname()[1]
            yield LiveFleet(f"http://127.0.0.1:{port}", rt, app, registry)
        finally:
            server.should_exit = True
            await serving
            sock.close()
