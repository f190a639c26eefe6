"""The batch lifecycle: explicit transitions, and a decision that only proposes them."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import (
    BATCH_CANCEL_GRACE_S,
    BATCH_TERMINAL,
    BATCH_TIMESTAMPS,
    BATCH_TRANSITIONS,
    BatchProgress,
    BatchStatus,
    RequestCounts,
    batch_can_move,
    batch_sources,
    next_batch_status,
)

S = BatchStatus


def test_the_openai_lifecycle() -> None:
    assert set(BATCH_TRANSITIONS) == set(BatchStatus)
    happy = [S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.COMPLETED]
    assert all(batch_can_move(a, b) for a, b in itertools.pairwise(happy))
    assert batch_can_move(S.VALIDATING, S.FAILED)
    assert batch_can_move(S.IN_PROGRESS, S.CANCELLING)
    assert batch_can_move(S.CANCELLING, S.CANCELLED)
    assert batch_can_move(S.IN_PROGRESS, S.EXPIRED)
    assert not batch_can_move(S.IN_PROGRESS, S.FAILED)
    assert not batch_can_move(S.FINALIZING, S.CANCELLING)
    assert not batch_can_move(S.CANCELLED, S.IN_PROGRESS)
    assert all(not BATCH_TRANSITIONS[s] for s in BATCH_TERMINAL)
    assert set(BATCH_TIMESTAMPS) == set(BatchStatus) - {S.VALIDATING}


@given(st.sampled_from(BatchStatus))
def test_sources_are_the_transitions_read_backwards(target: BatchStatus) -> None:
    for source in BatchStatus:
        assert (source in batch_sources(target)) == batch_can_move(source, target)


@given(st.data())
def test_every_walk_ends_in_a_terminal_status_within_four_moves(data: st.DataObject) -> None:
    status = S.VALIDATING
    for _ in range(4):
        if status in BATCH_TERMINAL:
            break
        status = data.draw(st.sampled_from(sorted(BATCH_TRANSITIONS[status])))
    assert status in BATCH_TERMINAL


progress = st.builds(
    lambda status, total, done, failed, in_flight, expires, cancelling: BatchProgress(
        status,
        expires,
        RequestCounts(total, min(done, total), min(failed, total - min(done, total))),
        in_flight,
        cancelling,
    ),
    st.sampled_from(BatchStatus),
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 50),
    st.floats(0, 1e6),
    st.floats(0, 1e6),
)


@given(progress, st.floats(0, 2e6))
def test_the_decision_only_proposes_allowed_moves(p: BatchProgress, now: float) -> None:
    target = next_batch_status(now, p)
    assert target is None or batch_can_move(p.status, target)
    if p.status in BATCH_TERMINAL:
        assert target is None


def test_a_batch_whose_lines_are_all_done_finalizes_even_past_its_window() -> None:
    done = BatchProgress(S.IN_PROGRESS, 100.0, RequestCounts(3, 2, 1))
    assert next_batch_status(200.0, done) is S.FINALIZING
    assert next_batch_status(200.0, BatchProgress(S.FINALIZING, 100.0)) is S.COMPLETED


def test_a_batch_with_lines_left_expires_at_the_end_of_its_window() -> None:
    running = BatchProgress(S.IN_PROGRESS, 100.0, RequestCounts(3, 1, 0), in_flight=1)
    assert next_batch_status(99.9, running) is None
    assert next_batch_status(100.0, running) is S.EXPIRED
    assert next_batch_status(100.0, BatchProgress(S.VALIDATING, 100.0)) is S.EXPIRED
    assert next_batch_status(99.0, BatchProgress(S.VALIDATING, 100.0)) is None


def test_cancelling_waits_for_lines_in_flight_up_to_the_grace() -> None:
    cancelling = BatchProgress(S.CANCELLING, 1e9, RequestCounts(5, 1, 0), 2, cancelling_at=10.0)
    assert next_batch_status(11.0, cancelling) is None
    assert next_batch_status(10.0 + BATCH_CANCEL_GRACE_S, cancelling) is S.CANCELLED
    idle = BatchProgress(S.CANCELLING, 1e9, RequestCounts(5, 1, 0), 0, cancelling_at=10.0)
    assert next_batch_status(11.0, idle) is S.CANCELLED


def test_request_counts_in_openai_shape() -> None:
    assert RequestCounts(3, 2, 1).to_openai() == {"total": 3, "completed": 2, "failed": 1}
