"""Token-bucket rate limiting, so a laptop can emulate a fleet of fast hosts and a real fleet can cap peerd."""
from __future__ import annotations

import asyncio
import threading
import time


PACE_S = 0.004          # a paced transfer pays about this much of its rate at a time


class _Meter:
    """Tokens refilled at ``rate`` up to ``burst``; ``charge`` takes n (into debt) and says how long
    the debt takes to clear."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = time.monotonic()
        self._lock = threading.Lock()     # chunk receives charge from worker threads, uploads from the loop

    def charge(self, n: int) -> float:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            return max(0.0, -self.tokens / self.rate)


class TokenBucket:
    """``rate`` bytes/s with a ``burst`` allowance; ``rate=None`` means unlimited.

    ``acquire`` may take more than the burst at once (it then waits for the debt), so one chunk can be
    sent with a single sendfile after one acquire.
    """

    def __init__(self, rate: float | None, burst: float | None = None):
        self.rate = rate
        self.burst = burst if burst is not None else (rate * 0.05 if rate else 0)
        self._all = _Meter(rate, self.burst) if rate else None
        self._first = _Meter(rate, self.burst) if rate else None    # priority traffic alone
        self._lock = asyncio.Lock()

    def piece(self, minimum: int, whole: int) -> int:
        """How many bytes to move between two payments: ``whole`` when unlimited, else about
        ``PACE_S`` of the rate and at least ``minimum`` (at 8 MiB/s the minimum; at 1 GiB/s 4 MiB,
        so a fast link is not paid for in thousands of small steps, each a trip through the loop)."""
        return whole if not self.rate else min(whole, max(minimum, int(self.rate * PACE_S)))

    def debt(self, n: int) -> float:
        """Charge ``n`` bytes already received and say how long the reader should pause (0 when
        unlimited). For a reader in a worker thread that sleeps instead of awaiting (peerd/chunk_fetch.py);
        concurrent readers each pause for the debt they find, so the total rate holds."""
        return self._all.charge(n) if self.rate else 0.0

    async def acquire(self, n: int, priority: bool = False) -> None:
        """Wait until ``n`` bytes may pass. ``priority`` bytes go first: they wait only for earlier
        priority bytes (never above ``rate`` on their own) and the others pay for them (the total rate
        holds; the others wait longer). Origin reads use it so the fleet's scarcest link never idles
        behind a peer download's debt (before, an origin piece waited out that debt: the 16-host
        bench's origin finished 7 % late)."""
        if not self.rate:
            return
        if priority:
            self._all.charge(n)
            wait = self._first.charge(n)
            if wait:
                await asyncio.sleep(wait)
            return
        async with self._lock:   # FIFO: one waiter at a time pays its debt
            wait = self._all.charge(n)
            if wait:
                await asyncio.sleep(wait)
