"""Routers by name: the fleet file's ``routing`` entry in, a fresh router out."""

from __future__ import annotations

from collections.abc import Mapping
from random import Random

from gpufleet.policy._config import (
    KVAwareConfig,
    LeastRequestConfig,
    PrecisePrefixConfig,
    PrefixAwareConfig,
    RoundRobinConfig,
    RouterConfig,
    SessionConfig,
    parse_router_config,
)
from gpufleet.policy._precise import PrecisePrefixRouter
from gpufleet.policy._prefix import PrefixAwareRouter
from gpufleet.policy._ranking import CandidateFilter, Router
from gpufleet.policy._routers import KVAwareRouter, LeastRequestRouter, RoundRobinRouter
from gpufleet.policy._session import SessionRouter


def make_router(
    config: RouterConfig | Mapping[str, object] | str,
    rng: Random,
    filters: tuple[CandidateFilter, ...] | None = None,
) -> Router:
    """A new router for ``config`` (a validated config, a fleet-file mapping or a name).

    ``rng`` is the run's seeded RNG (ties are broken with it); ``filters`` replaces the
    default candidate pipeline (routable replicas, or the pool in panic) when given.
    """
    if isinstance(config, Mapping | str):
        config = parse_router_config(config)
    match config:
        case RoundRobinConfig():
            return RoundRobinRouter(config, rng, filters)
        case LeastRequestConfig():
            return LeastRequestRouter(config, rng, filters)
        case KVAwareConfig():
            return KVAwareRouter(config, rng, filters)
        case PrefixAwareConfig():
            return PrefixAwareRouter(config, rng, filters)
        case PrecisePrefixConfig():
            return PrecisePrefixRouter(config, rng, filters)
        case SessionConfig():
            return SessionRouter(config, rng, filters)
