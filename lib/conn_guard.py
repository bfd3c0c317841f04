"""Bounds on connections a client holds open: one that has not sent a whole request head within
``header_timeout`` is closed (slow-loris), and past ``max_connections`` the connections that have not
yet made a request are closed first. Idle keep-alive connections are aiohttp's keepalive_timeout."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

log = logging.getLogger("lib.conn_guard")


class ConnectionGuard:
    def __init__(self, header_timeout: float, max_connections: int):
        self.header_timeout, self.max_connections = header_timeout, max_connections
        self._first_seen: dict[object, float] = {}
        self._heard: set[object] = set()            # handlers that delivered at least one request head

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self._heard.add(request.protocol)
        return await handler(request)

    def sweep(self, server: web.Server, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        conns = server.connections
        alive = set(conns)
        self._first_seen = {h: t for h, t in self._first_seen.items() if h in alive}
        self._heard &= alive
        silent = []
        for h in conns:
            first = self._first_seen.setdefault(h, now)
            if h not in self._heard:
                silent.append((first, h))
        silent.sort(key=lambda x: x[0])
        excess = max(0, len(conns) - self.max_connections)
        doomed = [h for i, (first, h) in enumerate(silent) if i < excess or now - first > self.header_timeout]
        for h in doomed:
            if h.transport is not None:
                h.transport.close()
        if doomed:
            log.info("closed connections that sent no request", extra={"closed": len(doomed), "open": len(conns)})
        return len(doomed)

    async def run(self, server: web.Server, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            self.sweep(server)


def run_guarded(app: web.Application, host: str, port: int, header_timeout: float = 10.0,
                max_connections: int = 4096, keepalive_timeout: float = 75.0, ready_file: Path | None = None) -> None:
    """``web.run_app`` with the guard in front (the model server and the router use this); returns on
    SIGTERM or SIGINT after a clean shutdown. Once listening it writes ``{"addr": ...}`` to ``ready_file``."""
    guard = ConnectionGuard(header_timeout, max_connections)
    app.middlewares.insert(0, guard.middleware)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=keepalive_timeout)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        if ready_file:
            ready_file.write_text(json.dumps({"addr": f"http://{host}:{runner.addresses[0][1]}"}))
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        sweeper = asyncio.create_task(guard.run(runner.server))
        try:
            await stop.wait()
        finally:
            sweeper.cancel()
            await runner.cleanup()

    asyncio.run(main())
