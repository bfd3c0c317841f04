"""The receive side of the chunk path alone: peerd's ``ChunkFetcher`` against aiohttp.

One HTTP server process serves chunk-sized bodies on loopback; this process receives them two ways,
alternating, and reports its own CPU seconds per GiB for each:

- ``aiohttp``: peerd's former receive path: ``iter_chunked(256 KiB)`` pieces, then one join
  into a contiguous chunk (what ``write_chunk`` did before hashing and writing);
- ``chunk_fetch``: peerd's path now (``peerd/chunk_fetch.py``): kept-alive blocking connections, each
  response received by a worker thread with ``recv_into(MSG_WAITALL)`` straight into one reused chunk
  buffer (no stream reader, no pieces, no join; an ``asyncio.BufferedProtocol`` was measured slower).

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

from peerd.chunk_fetch import ChunkFetcher
from peerd.ratelimit import TokenBucket
from lib.ports import free_ports

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


async def _with_aiohttp(url: str, size: int, count: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(count):
            async with s.get(url) as r:
                pieces = [p async for p in r.content.iter_chunked(PIECE)]
            if len(b"".join(pieces)) != size:
                raise RuntimeError("short body")


async def _with_chunk_fetch(port: int, path: str, size: int, count: int) -> None:
    fetcher = ChunkFetcher({}, TokenBucket(None), stall_after=30.0)
    into = memoryview(bytearray(size))           # one reused buffer, as peerd's BufferPool hands out
    try:
        for _ in range(count):
            await fetcher.fetch(f"http://127.0.0.1:{port}", path, into)
    finally:
        fetcher.close()


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
                "chunk_fetch": lambda: _with_chunk_fetch(port, path, size, count)}
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
    out["chunk_fetch_over_aiohttp_cpu"] = round(out["chunk_fetch"]["cpu_s_per_gib"] / out["aiohttp"]["cpu_s_per_gib"], 3)
    return out
