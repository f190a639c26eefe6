"""``PoolMembers``: which indices serve and which stand by (pure, no process)."""

from __future__ import annotations

import pytest

from gpufleet.runtime import PoolMembers


def test_a_new_pool_serves_the_first_indices_and_stands_by_after_them() -> None:
    members = PoolMembers.first(2, standby=1)
    assert members.serving == {0, 1}
    assert members.standby == {2}
    assert members.wanted() == [0, 1, 2]


def test_scale_in_retires_the_named_replica_not_the_highest_index() -> None:
    members = PoolMembers.first(3)
    members.scale(2, remove=(0,), taken={0, 1, 2})
    assert members.serving == {1, 2}
    # a repeated (level-triggered) call names a replica that no longer serves: nothing moves
    members.scale(2, remove=(0,), taken={0, 1, 2})
    assert members.serving == {1, 2}


def test_scale_in_past_the_named_replicas_retires_the_highest() -> None:
    members = PoolMembers.first(4)
    members.scale(1, remove=(1,), taken={0, 1, 2, 3})
    assert members.serving == {0}


def test_a_new_replica_never_takes_the_index_of_one_still_draining() -> None:
    members = PoolMembers.first(2)
    members.scale(1, remove=(0,), taken={0, 1})
    members.scale(2, remove=(), taken={0, 1})  # 0 still drains: its name is taken
    assert members.serving == {1, 2}
    members.scale(3, remove=(), taken={1, 2})  # 0 has stopped: its index is free again
    assert members.serving == {0, 1, 2}


def test_promotion_moves_a_standby_into_service_and_refill_replaces_it() -> None:
    members = PoolMembers.first(2, standby=2)
    assert members.promote((3, 0, 9)) == [3]  # only standbys move
    assert members.serving == {0, 1, 3}
    members.refill(taken={0, 1, 2, 3})
    assert members.standby == {2, 4}


def test_refill_retires_extra_standbys_warming_ones_first() -> None:
    members = PoolMembers.first(1, standby=3)
    members.standby_target = 1
    members.refill(taken={0, 1, 2, 3}, prefer_removing=(2,))
    assert members.standby == {1}


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        PoolMembers().scale(-1, remove=(), taken=set())
