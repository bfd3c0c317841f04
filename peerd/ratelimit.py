"""Token-bucket rate limiting, so a laptop can emulate a fleet of fast hosts and a real fleet can cap peerd."""
from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """``rate`` bytes/s with a ``burst`` allowance; ``rate=None`` means unlimited.

    ``acquire`` may take more than the burst at once (it then waits for the debt), so one chunk can be
    sent with a single sendfile after one acquire.
    """

    def __init__(self, rate: float | None, burst: float | None = None):
        self.rate = rate
        self.burst = burst if burst is not None else (rate * 0.05 if rate else 0)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    def _charge(self, n: int) -> float:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)

    async def acquire(self, n: int, priority: bool = False) -> None:
        """Wait until ``n`` bytes may pass. ``priority`` skips the queue but still pays (the total rate
        holds; the others wait longer): origin reads use it so the fleet's scarcest link never idles."""
        if not self.rate:
            return
        if priority:
            await asyncio.sleep(self._charge(n))
            return
        async with self._lock:   # FIFO: one waiter at a time pays its debt
            wait = self._charge(n)
            if wait:
                await asyncio.sleep(wait)
