"""Reused chunk buffers: handed out sized, kept up to a bound, and never handed out again while a
worker thread still reads one, even when the download that owned it was cancelled."""
import asyncio
import threading

import pytest

from peerd.buffer_pool import BufferPool


def test_buffers_are_reused_sized_and_kept_up_to_a_bound():
    pool = BufferPool(capacity=1000, keep=1)
    a, b = pool.take(1000), pool.take(10)
    assert len(a) == 1000 and len(b) == 10 and pool.allocated == 2
    first = a.obj
    pool.give(a)
    pool.give(b)                              # over the bound: dropped
    again = pool.take(500)
    assert again.obj is first and len(again) == 500 and pool.allocated == 2
    assert pool.take(1).obj is not first and pool.allocated == 3
    with pytest.raises(ValueError, match="does not fit"):
        pool.take(1001)
    in_use = pool.take(1000)
    pool.give(pool.take(1000))
    pool.close()                              # the job ended: nothing idle is kept, nor what comes back later
    assert pool._free == []
    pool.give(in_use)
    assert pool._free == []


@pytest.mark.asyncio
async def test_a_cancelled_owner_does_not_free_a_buffer_its_thread_still_reads():
    pool = BufferPool(capacity=64, keep=4)
    view = pool.take(64)
    started, release = threading.Event(), threading.Event()

    def work(v):
        started.set()
        release.wait(10)
        return bytes(v)

    owner = asyncio.create_task(pool.use_in_thread(view, work))
    await asyncio.to_thread(started.wait, 10)
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    await asyncio.sleep(0.05)
    assert pool._free == []                   # the thread is still reading: not back yet
    release.set()
    for _ in range(200):
        if pool._free:
            break
        await asyncio.sleep(0.01)
    assert len(pool._free) == 1 and pool.take(64).obj is not None and pool.allocated == 1


@pytest.mark.asyncio
async def test_the_work_result_and_errors_come_back_and_the_buffer_too():
    pool = BufferPool(capacity=8, keep=4)
    assert await pool.use_in_thread(pool.take(3), lambda v: len(v)) == 3

    def boom(v):
        raise OSError("disk gone")
    with pytest.raises(OSError, match="disk gone"):
        await pool.use_in_thread(pool.take(8), boom)
    await asyncio.sleep(0)
    assert len(pool._free) == 1 and pool.allocated == 1
