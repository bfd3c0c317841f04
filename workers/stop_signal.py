"""How a worker process ends: on SIGTERM or SIGINT it stops polling and its running activities are
cancelled (they resume on retry, on this host or another)."""
from __future__ import annotations

import asyncio
import signal


async def stop_requested() -> None:
    """Return once SIGTERM or SIGINT arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
