"""What a leaner chunk transport could save on the receive side, measured before building it.

One HTTP server process serves chunk-sized bodies on loopback; this process receives them two ways,
alternating, and reports its own CPU seconds per GiB for each:

- ``aiohttp``: peerd's receive path today (``FetchJob._from_peer``): ``iter_chunked(256 KiB)``
  pieces, then one join into a contiguous chunk (what ``write_chunk`` does before hashing and
  writing);
- ``buffered_protocol``: an ``asyncio.BufferedProtocol`` that receives straight into one
  pre-allocated chunk buffer on a kept-alive connection (no StreamReader, no pieces, no join).

Each timed request leaves one whole chunk in memory, ready to hash and write; hashing and writing
are not included (``bench throughput`` measures the whole path). The server's CPU is not counted.
"""
from __future__ import annotations

import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time

import aiohttp

from weightcast.stack.ports import free_ports

PIECE = 256 * 1024
ROUND_DEADLINE_S = 120.0      # one way's round; a hung server or client fails the bench instead of waiting


def serve(port: int) -> None:
    """The server process: ``GET /c/<n>`` answers n bytes (from one random 8 MiB block)."""
    from aiohttp import web
    block = os.urandom(8 * 2**20)

    async def chunk(req: web.Request) -> web.StreamResponse:
        n = int(req.match_info["n"])
        resp = web.StreamResponse(headers={"Content-Length": str(n)})
        await resp.prepare(req)
        left = n
        while left:
            k = min(left, len(block))
            await resp.write(block[:k])
            left -= k
        return resp

    app = web.Application()
    app.router.add_get("/c/{n}", chunk)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


class _ChunkReceiver(asyncio.BufferedProtocol):
    """One response at a time on a kept-alive connection, its body received in place."""

    def __init__(self) -> None:
        self.head = bytearray(64 * 1024)
        self.head_len = 0
        self.body = memoryview(bytearray(0))
        self.pos = 0
        self.in_body = False
        self.done: asyncio.Future | None = None

    def expect(self, size: int) -> asyncio.Future:
        self.body = memoryview(bytearray(size))
        self.pos = self.head_len = 0
        self.in_body = False
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.body[self.pos:] if self.in_body else memoryview(self.head)[self.head_len:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.in_body:
            self.pos += nbytes
        else:
            self.head_len += nbytes
            end = self.head.find(b"\r\n\r\n", 0, self.head_len)
            if end < 0:
                return
            if not self.head.startswith(b"HTTP/1.1 200"):
                self.done.set_exception(RuntimeError(bytes(self.head[:end]).decode(errors="replace")))
                return
            rest = self.head_len - end - 4            # body bytes that arrived with the head
            self.body[:rest] = self.head[end + 4:self.head_len]
            self.pos, self.in_body = rest, True
        if self.in_body and self.pos == len(self.body) and not self.done.done():
            self.done.set_result(self.body)

    def connection_lost(self, exc) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


async def _with_aiohttp(url: str, size: int, count: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(count):
            async with s.get(url) as r:
                pieces = [p async for p in r.content.iter_chunked(PIECE)]
            if len(b"".join(pieces)) != size:
                raise RuntimeError("short body")


async def _with_buffered_protocol(port: int, path: str, size: int, count: int) -> None:
    transport, proto = await asyncio.get_running_loop().create_connection(_ChunkReceiver, "127.0.0.1", port)
    try:
        for _ in range(count):
            done = proto.expect(size)
            transport.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            await done
    finally:
        transport.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_receive_bench(size: int, count: int, rounds: int) -> dict:
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-c", f"from bench.receive import serve; serve({port})"])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                asyncio.run(_with_aiohttp(f"http://127.0.0.1:{port}/c/1", 1, 1))
                break
            except aiohttp.ClientError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the bench's HTTP server did not start")
                time.sleep(0.1)
        path = f"/c/{size}"
        ways = {"aiohttp": lambda: _with_aiohttp(f"http://127.0.0.1:{port}{path}", size, count),
                "buffered_protocol": lambda: _with_buffered_protocol(port, path, size, count)}
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
        gib = size * count / 2**30
        for _ in range(rounds):                      # alternating: both see the same machine noise
            for name, way in ways.items():
                c0, t0 = _cpu(), time.monotonic()
                asyncio.run(asyncio.wait_for(way(), ROUND_DEADLINE_S))
                samples[name].append(((_cpu() - c0) / gib, size * count / 2**20 / (time.monotonic() - t0)))
    finally:
        server.terminate()
        server.wait(10)
    out = {"size": size, "count": count, "rounds": rounds,
           "includes": "socket to one contiguous chunk in memory per request; no hash, no write; receiver CPU only"}
    for name, s in samples.items():
        out[name] = {"cpu_s_per_gib": round(statistics.median(x for x, _ in s), 3),
                     "cpu_s_per_gib_all": [round(x, 3) for x, _ in s],
                     "mib_per_s": round(statistics.median(y for _, y in s))}
    out["protocol_over_aiohttp_cpu"] = round(out["buffered_protocol"]["cpu_s_per_gib"] / out["aiohttp"]["cpu_s_per_gib"], 3)
    return out
