"""Precise prefix routing over real sim engines' KV events (loopback HTTP and ZMQ).

Two gateways route to the same two engines, whose small KV caches evict: the shared-engine
case, where each gateway's approximate index sees only its own half of the traffic. A
prompt's cached share comes from the engine itself (``usage.prompt_tokens_details``).
"""

from __future__ import annotations

import io
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gpufleet.control import KvEvents, read_recording, replay
from gpufleet.engine.model import external_hash
from gpufleet.engine.server import SimBlockHasher, SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Upstream, create_gateway
from tests.gateway.conftest import FAST, MODEL, fleet, serve_app

ENGINE = SimEngineConfig(
    time_scale=FAST,
    max_model_len=2048,
    num_gpu_blocks_override=128,  # 2,048 tokens: the families below do not all fit
    kv_events={
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    },
)
HASHER = SimBlockHasher(ENGINE)


@contextmanager
def engines(n: int) -> Iterator[tuple[list[Upstream], list[Any]]]:
    with ExitStack() as stack:
        upstreams, apps = [], []
        for i in range(n):
            app = create_app(ENGINE)
            apps.append(app)
            url = stack.enter_context(serve_app(app))
            kv = app.state.engine.kv_events
            upstreams.append(
                Upstream(
                    ReplicaId(f"{MODEL}-{i}"),
                    MODEL,
                    url,
                    kv_events=kv.endpoint,
                    kv_replay=kv.replay_endpoint,
                )
            )
        yield upstreams, apps


def _held(app: Any, hashes: tuple[int, ...]) -> int:
    """Leading blocks of ``hashes`` the (idle) engine has cached now."""
    cached = {external_hash(h) for h in app.state.engine.model._kv.pool._cached}
    return next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))


def _queries(app: Any) -> int:
    return int(app.state.engine.model.stats().prefix_cache_queries)


@contextmanager
def gateway(
    policy: str, upstreams: list[Upstream], record: io.StringIO | None = None
) -> Iterator[tuple[str, Any]]:
    # one scrape, at the start, then none for an hour: both routers read the engines' loads
    # from scrapes, the one input of this seeded run that depends on timing; one full-suite
    # run on a loaded machine once saw approximate 0.584 against its usual 0.507 (the bar:
    # precise 0.606 beats it by 0.05). Without them each decision rests on the index alone
    config = fleet(
        replicas=len(upstreams), routing={"policy": policy}, gateway={"scrape_interval": 3600.0}
    )
    app = create_gateway(
        config,
        StaticReplicas(upstreams),
        CollectorRegistry(),
        kv_hasher=lambda pool, body: HASHER(body),
        record=record,
    )
    with serve_app(app) as url:
        deadline = time.monotonic() + 10
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.02)
        yield url, app


def _prompt(family: int, i: int) -> str:
    shared = " ".join(f"f{family}w{k}" for k in range(240))  # 15 blocks
    return shared + " " + " ".join(f"q{i}u{k}" for k in range(40))


@dataclass
class Run:
    hit_rate: float
    missed: int
    """Requests sent to an engine holding fewer of their leading blocks than another did."""
    apps: list[Any]


def _run(policy: str, seed: int = 3, record: io.StringIO | None = None, *, two: bool = True) -> Run:
    """80 prompts over 12 families, sent one at a time through two gateways chosen at random
    (``two=False``: the first only; it records its control events to ``record``)."""
    rng = random.Random(seed)
    cached = total = missed = 0
    with (
        engines(2) as (upstreams, engine_apps),
        gateway(policy, upstreams, record) as (a, app_a),
        gateway(policy, upstreams) as (b, app_b),
        httpx.Client(timeout=30) as client,
    ):
        time.sleep(0.3)  # the subscriptions reach the publishers (a lost start is replayed)
        for i in range(80):
            url = rng.choice((a, b))
            body = {
                "model": MODEL,
                "prompt": _prompt(rng.randrange(12), i),
                "max_tokens": 4,
                "ignore_eos": True,
            }
            held = [_held(e, HASHER(body)) for e in engine_apps]
            before = [_queries(e) for e in engine_apps]
            answer = client.post((url if two else a) + "/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            served = [_queries(e) != q for e, q in zip(engine_apps, before, strict=True)]
            missed += held[served.index(True)] < max(held)
            usage = answer.json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            total += usage["prompt_tokens"]
            time.sleep(0.02)  # the engine's events reach both gateways
        apps = [app_a, app_b]
    return Run(cached / total, missed, apps)


def test_precise_routing_beats_approximate_with_two_gateways_and_evicting_engines() -> None:
    approximate = _run("prefix_aware")
    recording = io.StringIO()
    precise = _run("prefix_precise", record=recording)
    for app in precise.apps:
        router = app.control.pools[MODEL].router
        feeds = router.snapshot().feeds
        assert len(feeds) == 2  # both engines' events reached this gateway
        assert all(f.applied > 0 and f.resync_from is None for f in feeds.values())
        assert app.control.kv_feeds.batches > 0
        router.check()
    # every request went to an engine holding the longest prefix any engine held; the
    # approximate index, seeing half the traffic, sent some elsewhere
    assert precise.missed == 0
    assert approximate.missed >= 3, approximate.missed
    assert precise.hit_rate > approximate.hit_rate + 0.05, (precise, approximate)
    # the first gateway's recording (its engines' batches included) replays exactly
    head, body = read_recording(io.StringIO(recording.getvalue()))
    lines = list(replay(head, body))
    assert sum(isinstance(r.event, KvEvents) for r, _ in lines) > 20
    assert all(recorded.commands == again for recorded, again in lines)
