"""The gateway's routers over simulated replicas: the same policy objects, fed by the sim.

``PolicyRouting`` is the fleet simulator's twin of the gateway's routing shell. It holds one
router per model, made by the same :func:`gpufleet.policy.make_router` from the same fleet
file entry and seeded as the gateway seeds it, and feeds it the same three things::

    arrival ─► RouteRequest(model, prefix hashes, prompt tokens, session)
            ─► router.rank(now, request, view) ─► first replica ─► on_request_start
    finish  ─► on_request_end(now, request, replica, SUCCESS)  (refused: CLIENT_ERROR)
    scrape  ─► every scrape_interval: view = replicas' running / waiting / KV usage, as of now

What each input knows, and when, is modelled as in the gateway:

* **In-flight counts are fresh.** The router keeps its own count, moved by every
  ``on_request_start`` / ``on_request_end``, at the instant they happen.
* **Engine metrics are stale.** ``kv_aware`` and ``prefix_aware`` read running, waiting and
  KV-cache usage from a :class:`~gpufleet.fleet.FleetView` rebuilt only at each scrape, every
  ``scrape_interval`` simulated seconds (the fleet file's ``gateway.scrape_interval``), with
  ``observed_at`` set to the scrape's time. Between scrapes every ranking sees the same view
  object, as the gateway's routers do. Pools whose router reads no scrape (its config has
  no ``max_scrape_age``) are never scraped, as in the gateway.
* **Prefix hashes name token blocks.** The gateway hashes the prompt *text* in blocks of 512
  characters, each hash chained over the blocks before it (:func:`text_prefix_hashes`). The
  simulator has token ids, not text, so it chains hashes over blocks of
  :data:`PREFIX_HASH_TOKENS` = 128 token ids (512 characters at ~4 characters per token),
  at most 256 blocks, tail dropped. Equal prompt prefixes give equal hash chains in both,
  and a difference in a block changes that block's hash and every one after it: the
  property the prefix index relies on. Trace prefix blocks (``hash_ids``, 512 tokens) are
  whole multiples of 128, so requests that share ``k`` trace blocks share ``4k`` hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from random import Random
from typing import Final

from gpufleet.fleet import (
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    RouteRequest,
)
from gpufleet.policy import PrefixAwareConfig, Router, RouterConfig, make_router
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._traces import TraceRequest

PREFIX_HASH_TOKENS: Final = 128
"""Token ids per prefix-hash block: the token count of the gateway's 512-character block."""
PREFIX_HASH_MAX_BLOCKS: Final = 256
"""At most this many blocks are hashed, as in the gateway."""


def token_prefix_hashes(
    ids: Sequence[int],
    block_tokens: int = PREFIX_HASH_TOKENS,
    max_blocks: int = PREFIX_HASH_MAX_BLOCKS,
) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full ``block_tokens``-id blocks of ``ids``.

    The token-id twin of :func:`gpufleet.fleet.text_prefix_hashes`: ``h0 = H(0, b0)``,
    ``h1 = H(h0, b1)``, … Hashes of integer tuples are not salted, so the chain is the same
    in every process (a seeded run stays one run).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    ids = tuple(ids)
    end = min(len(ids) // block_tokens, max_blocks) * block_tokens
    hashes: list[int] = []
    chained = 0
    for start in range(0, end, block_tokens):
        chained = hash((chained, ids[start : start + block_tokens]))
        hashes.append(chained)
    return tuple(hashes)


@dataclass(frozen=True, slots=True)
class SimPool:
    """One model's pool as the simulator lays it out: ``replicas`` drivers in a row."""

    name: str
    routing: RouterConfig
    replicas: int


class _Pool:
    __slots__ = ("hashes", "ids", "name", "router", "scraped")

    def __init__(self, name: str, router: Router, config: RouterConfig, ids: list[ReplicaId]):
        self.name = name
        self.router = router
        self.ids = ids
        self.scraped = hasattr(config, "max_scrape_age")
        """The router reads engine metrics, so the gateway scrapes this pool."""
        self.hashes = isinstance(config, PrefixAwareConfig)
        """The router reads prefix hashes (only then are they computed)."""


class PolicyRouting:
    """A :class:`~gpufleet.sim.Routing` that asks the fleet file's routers.

    Drivers are laid out pool after pool, in the order of ``pools``; replica ``i`` of pool
    ``name`` is ``"<name>-<i>"``, the gateway's names. A request goes to the pool its trace
    names (``TraceRequest.model``) when the fleet serves it, else to the first pool: traces
    name one model or none. Router ``i`` draws from ``Random(seed * 1000 + 2 * i)``, the
    gateway's seeding.

    Call :meth:`attach` after ``FleetHarness.start`` to scrape every ``scrape_interval``.
    """

    __slots__ = (
        "_by_name",
        "_index",
        "_open",
        "_pools",
        "_views",
        "matched_blocks",
        "routed",
        "scrape_interval",
        "scrapes",
        "view",
    )

    def __init__(self, pools: Sequence[SimPool], *, seed: int, scrape_interval: float) -> None:
        if not pools:
            raise ValueError("a fleet needs at least one model")
        self._pools: list[_Pool] = []
        self._index: dict[ReplicaId, int] = {}
        views: list[ReplicaView] = []
        for i, pool in enumerate(pools):
            if pool.replicas < 1:
                raise ValueError(f"model {pool.name!r} has no replicas to simulate")
            ids = [ReplicaId(f"{pool.name}-{k}") for k in range(pool.replicas)]
            router = make_router(pool.routing, Random(seed * 1000 + 2 * i))
            self._pools.append(_Pool(pool.name, router, pool.routing, ids))
            for replica in ids:
                self._index[replica] = len(views)
                views.append(ReplicaView(replica, pool.name, ReplicaState.READY))
        self._by_name = {p.name: p for p in self._pools}
        self._views = views
        self.view = FleetView.of(0.0, views)
        """What the routers see: rebuilt at each scrape, the same object in between."""
        self.scrape_interval = scrape_interval
        self._open: dict[int, tuple[_Pool, RouteRequest, ReplicaId]] = {}
        self.scrapes = 0
        self.routed = 0
        self.matched_blocks = 0
        """Prefix blocks the router believed cached on the replicas it picked (prefix_aware)."""

    @property
    def replica_ids(self) -> list[ReplicaId]:
        """Every replica's name, in driver order."""
        return [r.id for r in self._views]

    def pool_of(self, request: TraceRequest) -> str:
        """The model that serves ``request``."""
        model = request.model
        return model if model is not None and model in self._by_name else self._pools[0].name

    def attach(self, harness: FleetHarness) -> None:
        """Scrape the routers' pools every ``scrape_interval`` while the trace lasts."""
        if any(p.scraped for p in self._pools):
            drivers = harness.drivers
            harness.every(self.scrape_interval, lambda now: self.scrape(now, drivers))

    def scrape(self, now: float, drivers: Sequence[ReplicaDriver]) -> None:
        """One scrape round: every scraped replica's metrics as of ``now``."""
        views = list(self._views)
        for pool in self._pools:
            if not pool.scraped:
                continue
            for replica in pool.ids:
                i = self._index[replica]
                stats = drivers[i].model.stats()
                load = ReplicaLoad(
                    running=stats.num_running,
                    waiting=stats.num_waiting,
                    kv_cache_usage=min(1.0, stats.kv_cache_usage),
                    observed_at=now,
                )
                views[i] = ReplicaView(replica, pool.name, ReplicaState.READY, load)
        self._views = views
        self.view = FleetView.of(now, views)
        self.scrapes += 1

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int:
        pool = self._by_name[self.pool_of(request)]
        routed = RouteRequest(
            str(index),
            pool.name,
            prefix_hashes=token_prefix_hashes(prompt) if pool.hashes else (),
            prompt_tokens=len(prompt),
            session_key=request.session,
        )
        ranking = pool.router.rank(now, routed, self.view)
        replica = ranking.first()
        if replica is None:  # every replica is READY until faults are modelled
            raise RuntimeError(f"router {ranking.policy} ranked no replica of {pool.name!r}")
        pool.router.on_request_start(now, routed, replica)
        self._open[index] = (pool, routed, replica)
        self.routed += 1
        self.matched_blocks += ranking.matched(replica)
        return self._index[replica]

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None:
        pool, routed, replica_id = self._open.pop(index)
        outcome = Outcome.CLIENT_ERROR if rejected else Outcome.SUCCESS
        pool.router.on_request_end(now, routed, replica_id, outcome)

    def router(self, model: str) -> Router:
        """The router of ``model``'s pool (for tests: its ``snapshot()``)."""
        return self._by_name[model].router
