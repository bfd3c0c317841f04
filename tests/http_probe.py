"""Raw HTTP for the tests that probe servers with what a hostile or odd client sends (any method, body
and header, no client library smoothing it over), and in-process servers such a synchronous probe
loop can call. Shared by the fuzz, property and authentication tests."""
from __future__ import annotations

import asyncio
import http.client
import os
import threading
from urllib.parse import urlparse

from hypothesis import HealthCheck, settings

from weightcast.stack.embedded import serve_app

# the standing fuzz and property tests' budget (WEIGHTCAST_FUZZ_EXAMPLES raises it for a long run)
SETTINGS = settings(max_examples=int(os.environ.get("WEIGHTCAST_FUZZ_EXAMPLES", "120")), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def request(addr: str, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers) of one request on a fresh connection."""
    u = urlparse(addr)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        c.close()


class AppThread:
    """aiohttp apps on their own event loop in a thread, so a synchronous probe loop can call them."""

    def __init__(self, *apps):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        started = [asyncio.run_coroutine_threadsafe(serve_app(a), self.loop).result(30) for a in apps]
        self.runners = [r for r, _ in started]
        self.addrs = [a for _, a in started]

    def stop(self):
        for r in self.runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
