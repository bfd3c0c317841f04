"""`weightcast bench gossip`: the CPU of one push exchange with a real peerd, both ways it can travel.

One peerd process (no job, no origin) is pushed to by ``peers`` simulated members at once, from this
process, alternating by round:

- ``http``: ``POST /v1/gossip`` with a full gossip message, answered by peerd's full message (what
  every push cost before HAVE links, and what ``--no-have-stream`` still does);
- ``have``: a news frame ``{"have": {vid: [chunk]}, "load": x}`` on an open ``/v1/have`` link per
  member, answered by peerd's news frame.

Reported per exchange: this process's CPU (the pushing side), the peerd's CPU (from /proc; the
answering side) and their sum, in milliseconds. Opening the links and the first full messages are
not timed: a link lives for the whole download. Both sides' JSON and the daemon's absorbing are
included; with no job running, absorbing stops at the membership update (in a swarm a push also
updates the policy, the same on both paths or cheaper on links: ``peer_has`` on a few ids instead of a
whole bitmap's diff).
"""
from __future__ import annotations

import asyncio
import json
import resource
import secrets
import shutil
import statistics
import tempfile
from pathlib import Path

import aiohttp

from bench.throughput import cpu_seconds
from peerd.signing import generate_keypair
from weightcast.stack.peerd_proc import PeerdProc
from lib.ports import free_ports

ROUND_DEADLINE_S = 120.0      # every wait: a hung peerd fails the bench instead of holding it


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _member(i: int) -> dict:
    return {"id": f"bench{i}", "addr": f"http://127.0.0.1:{1 + i}", "rack": ""}


def _full(i: int) -> dict:
    return {"from": _member(i), "versions": {"a" * 64: "AAAA"}, "peers": [], "load": 0.25}


async def _timed(fn, n: int, pid: int) -> tuple[float, float]:
    c0, s0 = _self_cpu(), cpu_seconds(pid)
    await asyncio.wait_for(fn(n), ROUND_DEADLINE_S)
    return _self_cpu() - c0, cpu_seconds(pid) - s0


async def run_gossip_bench(exchanges: int = 3000, rounds: int = 2, peers: int = 15) -> dict:
    work = Path(tempfile.mkdtemp(prefix="wc-bench-gossip-"))
    generate_keypair(work / "key.pem", work / "key.pub")
    token = secrets.token_hex(16)
    proc = PeerdProc("g", free_ports(1)[0], work / "store", ["--trusted-key", str(work / "key.pub"),
                                                             "--log-level", "WARNING"], token=token)
    proc.start()
    auth = {"Authorization": f"Bearer {token}"}
    try:
        async with aiohttp.ClientSession(headers=auth) as s:
            bodies = [json.dumps(_full(i)).encode() for i in range(peers)]
            news = json.dumps({"have": {"a" * 64: [7]}, "load": 0.25})

            async def http_round(n: int) -> None:
                async def one(i: int) -> None:
                    async with s.post(proc.addr + "/v1/gossip", data=bodies[i],
                                      headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 200, r.status
                        await r.json()
                for _ in range(n // peers):
                    await asyncio.gather(*(one(i) for i in range(peers)))

            async def open_link(i: int) -> aiohttp.ClientWebSocketResponse:
                ws = await s.ws_connect(proc.addr + "/v1/have")
                await ws.send_str(bodies[i].decode())
                await ws.receive_json()
                return ws
            # every link opened with its full message (not timed: a link lives for the whole download)
            links = await asyncio.wait_for(asyncio.gather(*(open_link(i) for i in range(peers))), ROUND_DEADLINE_S)

            async def have_round(n: int) -> None:
                async def one(ws) -> None:
                    await ws.send_str(news)
                    msg = await ws.receive()
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    json.loads(msg.data)
                for _ in range(n // peers):
                    await asyncio.gather(*(one(ws) for ws in links))

            await _timed(http_round, peers * 10, proc.proc.pid)     # warm both paths (not reported)
            await _timed(have_round, peers * 10, proc.proc.pid)
            n = max(peers, exchanges // peers * peers)
            runs: dict[str, list[tuple[float, float]]] = {"http": [], "have": []}
            for _ in range(rounds):
                runs["http"].append(await _timed(http_round, n, proc.proc.pid))
                runs["have"].append(await _timed(have_round, n, proc.proc.pid))
            for ws in links:
                await ws.close()
        out: dict = {"exchanges_per_round": n, "rounds": rounds, "peers": peers}
        for way, rs in runs.items():
            client = [c / n * 1e3 for c, _ in rs]
            server = [p / n * 1e3 for _, p in rs]
            out[way] = {"client_ms": round(statistics.median(client), 4), "peerd_ms": round(statistics.median(server), 4),
                        "total_ms": round(statistics.median(c + p for c, p in zip(client, server)), 4),
                        "total_ms_all": [round(c + p, 4) for c, p in zip(client, server)]}
        out["have_over_http"] = round(out["have"]["total_ms"] / max(out["http"]["total_ms"], 1e-9), 3)
        return out
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
