"""Bounds on connections a client holds open: one that has not sent a whole request head within
``header_timeout`` is closed (slow-loris), and so is one whose request body has not all arrived
within ``body_timeout`` of its head (a trickled body); past ``max_connections`` the connections still
waiting on their client (no request yet, or a body still arriving) are closed first. Idle keep-alive
connections are aiohttp's keepalive_timeout."""
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
    def __init__(self, header_timeout: float, max_connections: int, body_timeout: float = 60.0):
        self.header_timeout, self.max_connections, self.body_timeout = header_timeout, max_connections, body_timeout
        self._first_seen: dict[object, float] = {}
        self._heard: set[object] = set()            # handlers that delivered at least one whole request
        self._bodies: dict[object, tuple[float, web.Request]] = {}    # handler -> (head at, request) whose body is due

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.body_exists and not request.content.is_eof():
            self._bodies[request.protocol] = (time.monotonic(), request)
        else:
            self._heard.add(request.protocol)
        try:
            return await handler(request)
        finally:
            self._bodies.pop(request.protocol, None)
            self._heard.add(request.protocol)

    def sweep(self, server: web.Server, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        conns = server.connections
        alive = set(conns)
        self._first_seen = {h: t for h, t in self._first_seen.items() if h in alive}
        self._heard &= alive
        silent, overdue = [], []
        for h in conns:
            first = self._first_seen.setdefault(h, now)
            body = self._bodies.get(h)
            if body is not None and not body[1].content.is_eof():     # a body still arriving
                silent.append((body[0], h))
                if now - body[0] > self.body_timeout:
                    overdue.append(h)
            elif h not in self._heard and body is None:
                silent.append((first, h))
                if now - first > self.header_timeout:
                    overdue.append(h)
        silent.sort(key=lambda x: x[0])
        excess = max(0, len(conns) - self.max_connections)
        doomed = list({h: None for h in [h for _, h in silent[:excess]] + overdue})
        for h in doomed:
            if h.transport is not None:
                h.transport.close()
        if doomed:
            log.info("closed connections still waiting on their client (no request head, or a body not "
                     "arriving)", extra={"closed": len(doomed), "open": len(conns)})
        return len(doomed)

    async def run(self, server: web.Server, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            self.sweep(server)


def run_guarded(app: web.Application, host: str, port: int, header_timeout: float = 10.0,
                max_connections: int = 4096, keepalive_timeout: float = 75.0, ready_file: Path | None = None,
                body_timeout: float = 60.0) -> None:
    """``web.run_app`` with the guard in front (the model server and the router use this); returns on
    SIGTERM or SIGINT after a clean shutdown. Once listening it writes ``{"addr": ...}`` to ``ready_file``."""
    guard = ConnectionGuard(header_timeout, max_connections, body_timeout)
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
