"""Waiting for a condition in a test, without fixed sleeps."""
from __future__ import annotations

import asyncio
import inspect
import time


async def until(predicate, timeout: float = 60.0, what: str = "the condition", every: float = 0.05):
    """Poll ``predicate`` (plain or async) until it returns something true, and return that; a
    TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what}")
        await asyncio.sleep(every)


def until_sync(predicate, timeout: float = 60.0, what: str = "the condition", every: float = 0.05):
    """``until`` for code outside an event loop."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout} s: {what}")
        time.sleep(every)
    return value
