"""Bounds on connections a client holds open: one that has not sent a whole request head within
``header_timeout`` is closed (slow-loris), and past ``max_connections`` the connections that have not
yet made a request are closed first. Idle keep-alive connections are aiohttp's keepalive_timeout."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

log = logging.getLogger("peerd.conn_guard")


class ConnectionGuard:
    def __init__(self, header_timeout: float, max_connections: int):
        self.header_timeout, self.max_connections = header_timeout, max_connections
        self._first_seen: dict[object, float] = {}
        self._heard: set[object] = set()            # handlers that delivered at least one request head
        self.closed = 0

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
            self.closed += 1
        if doomed:
            log.info("closed connections that sent no request", extra={"closed": len(doomed), "open": len(conns)})
        return len(doomed)

    async def run(self, server: web.Server, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            self.sweep(server)
