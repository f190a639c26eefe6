"""A gateway with tenancy on (keys in a real SQLite store) over real sim replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
from prometheus_client import CollectorRegistry

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.control import PoolController
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Upstream, create_gateway
from gpufleet.gateway._tenancy import Tenancy
from gpufleet.store import Store
from tests.gateway.conftest import MODEL, Running, serve_app

ADMIN = "admin-secret-for-tests"


def tenant_fleet(
    *, gateway: dict[str, Any] | None = None, args: Sequence[str] = (), **tenants: Any
) -> FleetConfig:
    """A fleet of ``MODEL`` with auth on; ``args`` its engine flags (``--max-num-seqs``:
    what the gateway judges the pool's saturation by)."""
    return parse_fleet(
        {
            "models": [{"name": MODEL, "routing": "least_request", "args": list(args)}],
            "gateway": gateway or {},
            "tenants": {"auth": True, "refresh_interval": 0.2, **tenants},
        }
    )


class TenantGateway(Running):
    store: Store
    tenancy: Tenancy

    @property
    def pool(self) -> PoolController:
        """``MODEL``'s pool controller (its admission queue, its requests in flight)."""
        return self.app.control.pools[MODEL]

    def saturated(self) -> bool:
        """Whether ``MODEL``'s pool is saturated by the admission rule."""
        pool = self.pool
        assert pool.admission is not None
        return pool.admission.saturated(pool.routable())

    def flush(self) -> None:
        """Move the journal into the database now (the flusher does it every few ms)."""
        self.tenancy.journal.flush()


@contextmanager
def serve_tenant_gateway(
    tmp: Path, config: FleetConfig, urls: Sequence[str], *, record: IO[str] | None = None
) -> Iterator[TenantGateway]:
    """``record``: the gateway's control events and decisions go there (JSON lines)."""
    store = Store.open(f"sqlite:///{tmp / 'gpufleet.db'}")
    tenancy = Tenancy(
        config, store, journal=store.journal(tmp / "journal", flush_interval=0.02), admin_key=ADMIN
    )
    replicas = [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, url) for i, url in enumerate(urls)]
    registry = CollectorRegistry()
    app = create_gateway(config, StaticReplicas(replicas), registry, tenancy=tenancy, record=record)
    try:
        with serve_app(app) as url:
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "gateway not ready"
                time.sleep(0.02)
            running = TenantGateway(url, app, registry)
            running.store = store
            running.tenancy = tenancy
            yield running
    finally:
        store.close()
