"""Chunk buffers reused across a job's downloads.

A chunk is received straight into one of these and hashed and written from it. A fresh multi-MiB
buffer per chunk costs a page fault and a zeroed page for every 4 KiB of it (as much CPU as the
copy itself); a reused one is already resident. A buffer goes back to the pool only once nothing
(the socket, a worker thread hashing or writing it) can still touch it: ``use_in_thread``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class BufferPool:
    def __init__(self, capacity: int, keep: int):
        self.capacity = capacity      # every buffer holds the largest chunk
        self.keep = keep              # free buffers kept; more are dropped when given back
        self._free: list[bytearray] = []
        self.allocated = 0

    def take(self, size: int) -> memoryview:
        if size > self.capacity:
            raise ValueError(f"a {size}-byte chunk does not fit this pool's {self.capacity}-byte buffers")
        if self._free:
            buf = self._free.pop()
        else:
            buf = bytearray(self.capacity)
            self.allocated += 1
        return memoryview(buf)[:size]

    def close(self) -> None:
        """The job is over: free the idle buffers now, and any still in use as they come back."""
        self.keep = 0
        self._free.clear()

    def give(self, view: memoryview) -> None:
        buf = view.obj
        view.release()
        if len(self._free) < self.keep:
            self._free.append(buf)

    async def use_in_thread(self, view: memoryview, work: Callable[[memoryview], T]) -> T:
        """``work(view)`` in a worker thread, then the buffer back to the pool. A cancel of the caller
        does not hand the buffer out again while the thread still reads it: it returns when the thread
        is done (an executor future cancelled by its awaiter counts as done at once, so it is shielded)."""
        fut = asyncio.get_running_loop().run_in_executor(None, work, view)
        fut.add_done_callback(lambda _: self.give(view))
        return await asyncio.shield(fut)
