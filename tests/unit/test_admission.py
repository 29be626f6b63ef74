"""Admission: a bounded number running, a bounded queue with a deadline, then Overloaded."""

import asyncio

import pytest

from pdserve.gateway.admission import Admission, Overloaded


async def test_running_then_queued_then_refused():
    admission = Admission(max_running=1, max_waiting=1, wait_timeout_s=5)
    await admission.acquire()
    waiter = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    assert (admission.num_running, admission.num_waiting) == (1, 1)
    with pytest.raises(Overloaded, match="busy"):
        await admission.acquire()  # the queue is full
    admission.release()
    await asyncio.wait_for(waiter, 1)
    assert (admission.num_running, admission.num_waiting) == (1, 0)
    admission.release()
    assert admission.num_running == 0


async def test_a_wait_past_the_deadline_is_refused():
    admission = Admission(max_running=1, max_waiting=4, wait_timeout_s=0.05)
    async with admission.slot():
        with pytest.raises(Overloaded, match="0.05s"):
            await admission.acquire()
    assert (admission.num_running, admission.num_waiting) == (0, 0)
    async with admission.slot():
        assert admission.num_running == 1


def test_release_without_acquire_is_a_bug():
    with pytest.raises(RuntimeError, match="bug"):
        Admission(1, 1, 1).release()
