"""Leader election on a Lease against the fake API server: NO REAL CLUSTER RUNS HERE.

``fake_api.FakeKubeApi`` keeps the Lease with its own ``resourceVersion`` and answers a PUT of
an older version with ``409 Conflict``, as the API server's optimistic concurrency does. Most
tests drive ``try_once`` by hand on a manual clock, so expiry and deadlines are exact; the last
ones run the campaign loop in real time with sub-second periods.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from gpufleet.runtime.kubernetes import (
    GATEWAY,
    NOTE_ANNOTATION,
    ApiConfig,
    KubeApi,
    LeaderElection,
    LeaseSettings,
    default_identity,
)

from .fake_api import FakeKubeApi, serving

NS = "gpufleet"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{GATEWAY}"
SETTINGS = LeaseSettings(lease_duration_s=3.0, renew_deadline_s=2.0, retry_period_s=0.05)

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def api(url: str) -> AsyncIterator[KubeApi]:
    async with KubeApi(ApiConfig(url), timeout_s=1.0) as client:
        yield client


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_settings_keep_the_retry_inside_the_deadline_inside_the_lease() -> None:
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s"):
        LeaseSettings(lease_duration_s=10, renew_deadline_s=10)
    assert default_identity() != default_identity()  # a restarted container is a new candidate


async def test_the_first_candidate_creates_the_lease_and_the_second_waits() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    async with serving(fake) as url, api(url) as client:
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        b = LeaderElection(client, NS, "gw-b", SETTINGS, clock=clock)
        assert await a.try_once()
        assert not await b.try_once()
        assert (b.holder, fake.holder()) == ("gw-a", "gw-a")
        clock.now += 1.0
        assert await a.try_once()  # renewed: a conditional update of the version it read
        assert not await b.try_once()

    created = fake.calls_to("POST", "/leases")
    assert [c.path for c in created] == [f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"]
    assert created[0].body is not None
    spec = created[0].body["spec"]
    assert spec["holderIdentity"] == "gw-a"
    assert spec["leaseDurationSeconds"] == 3
    assert spec["leaseTransitions"] == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", spec["renewTime"])
    (renewal,) = fake.calls_to("PUT", LEASE_PATH)
    assert renewal.body is not None
    assert renewal.body["metadata"]["resourceVersion"] == "1001"  # the version it created
    assert renewal.body["spec"]["acquireTime"] == spec["acquireTime"]  # the same term
    assert renewal.body["spec"]["leaseTransitions"] == 0


async def test_a_lease_is_taken_over_only_after_it_went_unrenewed_for_its_duration() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    async with serving(fake) as url, api(url) as client:
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        b = LeaderElection(client, NS, "gw-b", SETTINGS, clock=clock)
        assert await a.try_once()
        assert not await b.try_once()  # b starts its expiry clock now
        # a dies without releasing; b sees the record unchanged ...
        clock.now += 2.9
        assert not await b.try_once()
        clock.now += 0.2  # ... for the lease's duration (3 s) on b's own clock
        assert await b.try_once()
        assert fake.holder() == "gw-b"
        lease = fake.leases[GATEWAY]["spec"]
        assert lease["leaseTransitions"] == 1
        assert lease["acquireTime"] == lease["renewTime"]
        # a comes back: the lease names b, so a steps down at once rather than at its deadline
        assert not await a.try_once()
        assert a.holder == "gw-b"


async def test_renewals_keep_a_lease_alive_however_old_its_acquisition() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    async with serving(fake) as url, api(url) as client:
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        b = LeaderElection(client, NS, "gw-b", SETTINGS, clock=clock)
        assert await a.try_once()
        for _ in range(5):  # 10 s of 2-second renewals: never 3 s without a change
            clock.now += 2.0
            assert await a.try_once()
            assert not await b.try_once()
    assert a.terms == 1


async def test_two_candidates_that_both_see_an_expired_lease_cannot_both_win() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    async with serving(fake) as url, api(url) as client:
        dead = LeaderElection(client, NS, "gw-dead", SETTINGS, clock=clock)
        assert await dead.try_once()
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        b = LeaderElection(client, NS, "gw-b", SETTINGS, clock=clock)
        assert not await a.try_once()
        assert not await b.try_once()
        clock.now += 5.0  # expired for both
        for _ in range(5):  # both read version v and update "v": one update must fail
            won = await asyncio.gather(a.try_once(), b.try_once())
            assert sorted(won) == [False, True], won
            winner, loser = (a, b) if won[0] else (b, a)
            assert fake.holder() == winner.identity
            # hand it back to the dead holder and expire it again for the next round
            await client.put(
                LEASE_PATH,
                {
                    **fake.leases[GATEWAY],
                    "spec": {**fake.leases[GATEWAY]["spec"], "holderIdentity": "gw-dead"},
                },
            )
            assert not await loser.try_once()
            assert not await winner.try_once()
            clock.now += 5.0
    assert fake.conflicts >= 1  # the race did happen: an update lost to the other's


async def test_a_conflict_or_a_failed_create_means_not_leading() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    async with serving(fake) as url, api(url) as client:
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        fake.fail("POST", "/leases", 409)  # another candidate created it first
        assert not await a.try_once()
        assert await a.try_once()
        clock.now += 1.0
        fake.fail("PUT", "/leases", 409)  # a renewal refused: still leading, within deadline
        assert await a.try_once()
        clock.now += 1.0
        assert await a.try_once()


async def test_the_leader_steps_down_when_the_api_server_is_gone_before_others_may_lead() -> None:
    fake, clock = FakeKubeApi(NS), Clock()
    server = serving(fake)
    url = await server.__aenter__()
    port = int(url.rsplit(":", 1)[1])
    changes: list[bool] = []
    async with api(url) as client:
        a = LeaderElection(client, NS, "gw-a", SETTINGS, clock=clock)
        a.subscribe(changes.append)
        b = LeaderElection(client, NS, "gw-b", SETTINGS, clock=clock)
        assert await a.try_once()
        assert not await b.try_once()
        await server.__aexit__(None, None, None)  # refused from now on
        clock.now += 1.9
        assert await a.try_once()  # within its renew deadline: still acting
        clock.now += 0.2
        assert not await a.try_once()  # 2.1 s without renewal > 2 s: stepped down
        assert changes == [True, False]
        async with serving(fake, port):
            # b may take over only once the lease went 3 s unchanged: after a stopped acting
            clock.now += 0.8
            assert not await b.try_once()
            clock.now += 0.2
            assert await b.try_once()
            assert not await a.try_once()


async def test_the_leaders_note_reaches_the_others_and_leaves_with_the_release() -> None:
    fake = FakeKubeApi(NS)
    fast = LeaseSettings(lease_duration_s=2.0, renew_deadline_s=1.0, retry_period_s=0.02)
    async with serving(fake) as url, api(url) as client:
        a = LeaderElection(client, NS, "gw-a", fast)
        b = LeaderElection(client, NS, "gw-b", fast)
        seen: list[bool] = []
        b.subscribe(seen.append)
        async with asyncio.TaskGroup() as tg:
            run_a = tg.create_task(a.run())
            await eventually(lambda: a.leading)
            run_b = tg.create_task(b.run())
            a.set_note("pod-x,pod-y")  # written with an early renewal
            await eventually(lambda: b.peer_note == "pod-x,pod-y")
            assert fake.leases[GATEWAY]["metadata"]["annotations"] == {
                NOTE_ANNOTATION: "pod-x,pod-y"
            }
            assert seen  # b's listener heard of the note
            run_a.cancel()  # shutdown: a releases, b takes over without waiting 2 s
            loop = asyncio.get_running_loop()
            released = loop.time()
            await eventually(lambda: b.leading, timeout=1.0)
            took = loop.time() - released
            assert not a.leading
            assert b.peer_note == ""
            assert NOTE_ANNOTATION not in fake.leases[GATEWAY]["metadata"].get("annotations", {})
            run_b.cancel()
        assert fake.holder() is None  # b released it too
    print(f"\ntake-over after a release: {took * 1000:.0f} ms (lease duration 2 s)")
