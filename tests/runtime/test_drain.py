"""The drain-completion rule both runtimes share (runtime._drain)."""

from __future__ import annotations

import asyncio

import pytest

from gpufleet.runtime._drain import IDLE_READS, IdleCounter, in_flight, wait_idle


def test_two_consecutive_idle_reads_end_a_drain_and_busy_or_unknown_start_over() -> None:
    counter = IdleCounter()
    seen = [counter.saw(busy) for busy in (0, None, 0, 3, 0, 0)]
    assert seen == [False, False, False, False, False, True]
    assert IDLE_READS == 2


class Reads:
    def __init__(self, *values: int | None) -> None:
        self.values = list(values)
        self.calls = 0

    async def __call__(self) -> int | None:
        self.calls += 1
        return self.values.pop(0)


@pytest.mark.asyncio
async def test_wait_idle_reads_until_the_rule_holds() -> None:
    read = Reads(2, 0, None, 0, 0, 7)
    assert await wait_idle(read, 0.0) is True
    assert read.calls == 5


@pytest.mark.asyncio
async def test_wait_idle_stops_when_the_replica_is_no_longer_draining() -> None:
    read = Reads(1, 1, 1)
    calls = iter([True, True, False])
    assert await wait_idle(read, 0.0, draining=lambda: next(calls)) is False
    assert read.calls == 2


@pytest.mark.asyncio
async def test_a_deadline_is_the_callers_timeout() -> None:
    async def busy() -> int | None:
        return 1

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await wait_idle(busy, 0.01)


def test_in_flight_is_running_plus_waiting_from_the_engine_metrics() -> None:
    text = "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n"
    assert in_flight(text) == 5
    assert in_flight("# nothing here\n") is None
