"""The slots a NIXL endpoint lends under leases (``pdserve.worker.nixl.SlotPool``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pdserve.worker.nixl import SlotPool  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slots_are_lent_and_given_back() -> None:
    pool = SlotPool(4)
    assert pool.take(3, "a") == [0, 1, 2]
    assert pool.take(2, "b") is None  # too few free: nothing taken
    assert pool.num_free == 1
    assert pool.take(1, "a") is None  # a lease's name is used once at a time
    assert pool.release("a") == 3
    assert pool.release("a") == 0  # ended already (a second reader's notification)
    assert sorted(pool.take(4, "c")) == [0, 1, 2, 3]


def test_leases_expire_in_order() -> None:
    clock = Clock()
    pool = SlotPool(4, lease_s=10.0, clock=clock)
    pool.take(2, "old")
    clock.now = 5.0
    pool.take(2, "new")
    clock.now = 10.5
    assert pool.expire() == 1 and pool.num_free == 2
    assert pool.release("old") == 0
    clock.now = 15.5
    assert pool.take(4, "all") is not None  # taking expires what is due first
    assert pool.expired == 2


def test_consecutive_blocks_read_as_one_run() -> None:
    from pdserve.worker.nixl import coalesce

    # Slots 0-2 from the peer's 10-12, then slot 3 from its 20, then slot 5 from its 21.
    pairs = [(0, 100), (10, 110), (20, 120), (30, 200), (50, 210)]
    assert coalesce(pairs, 10) == [(0, 100, 30), (30, 200, 10), (50, 210, 10)]
    assert coalesce([], 10) == []
