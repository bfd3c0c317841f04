"""HAVE links (peerd/have_stream.py) at a real peerd: authenticated, strict about frames (a frame that
breaks the protocol closes the link with the reason, never the daemon), and, towards a peer without
them, the HTTP exchange instead."""
import asyncio
import time
import uuid

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from peerd.have_stream import RETRY_LINK_S, HaveLinks
from peerd.membership import Member
from peerd.wire import pack_bits
from tests.fleet import TOKEN, Fleet, publish
from lib.ports import free_ports

AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLICY_VIOLATION = 1008


def hello(peer_id="p", versions=None):
    return {"from": {"id": peer_id, "addr": "http://127.0.0.1:1", "rack": ""}, "versions": versions or {},
            "peers": [], "load": 0.25}


@pytest.fixture
def daemon(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"], extra={"x": ["--dead-after", "60"]}).start()
    yield fleet
    fleet.stop()


async def refused(addr: str, frames: list, reason: str) -> None:
    """Open a link, send ``frames`` (dicts as JSON text, str as text, bytes as binary), expect the link closed by
    the daemon with 1008 and ``reason`` in the close message."""
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(addr + "/v1/have", headers=AUTH)
        msg = None
        for f in frames:
            await (ws.send_bytes(f) if isinstance(f, bytes) else ws.send_str(f) if isinstance(f, str) else ws.send_json(f))
            msg = await asyncio.wait_for(ws.receive(), 10)
        assert msg.type == aiohttp.WSMsgType.CLOSE, (frames, msg)
        assert ws.close_code == POLICY_VIOLATION and reason in msg.extra, (ws.close_code, msg.extra)
        await ws.close()


async def test_a_link_needs_the_cluster_token(daemon):
    addr = daemon.procs["x"].addr
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(addr + "/v1/have", headers=headers)
            assert e.value.status == 401
        async with s.get(addr + "/v1/have", headers=AUTH) as r:      # not a websocket upgrade: a 4xx
            assert r.status == 400 and "error" in await r.json()


async def test_a_link_answers_a_full_message_and_then_news(daemon):
    addr = daemon.procs["x"].addr
    async with aiohttp.ClientSession() as s, daemon.client("x") as c:
        ws = await s.ws_connect(addr + "/v1/have", headers=AUTH)
        await ws.send_json(hello())
        full = await asyncio.wait_for(ws.receive_json(), 10)
        assert full["from"]["id"] == "x" and full["versions"] == {} and full["load"] == 0.0
        await ws.send_json({"have": {}, "load": 0.5})
        news = await asyncio.wait_for(ws.receive_json(), 10)
        assert news == {"have": {}, "load": 0.0}          # nothing verified here since the full message
        members = {m["id"]: m for m in (await c.status())["members"]}
        assert "p" in members and not members["p"]["dead"]   # the link's first message made 'p' a member
        assert await c.metric('peerd_have_frames_total{direction="received"}') == 2
        assert await c.metric('peerd_have_links{direction="in"}') == 1
        await ws.close()
        for _ in range(50):                                  # the daemon sees the close
            if await c.metric('peerd_have_links{direction="in"}') == 0:
                break
            await asyncio.sleep(0.1)
        assert await c.metric('peerd_have_links{direction="in"}') == 0


async def test_a_frame_that_breaks_the_protocol_closes_the_link_with_the_reason(daemon):
    addr = daemon.procs["x"].addr
    await refused(addr, [{"have": {}, "load": 0}], "first frame must be a full gossip message")
    await refused(addr, [b"\x00\x01"], "JSON text")
    await refused(addr, [{"from": {"id": "../x", "addr": "http://a:1"}}], "peer id")
    await refused(addr, [hello(), {"have": {"a" * 64: ["seven"]}, "load": 0}], "list of chunk ids")
    await refused(addr, [hello(), {"have": {}, "load": "half"}], "load")
    await refused(addr, [hello("p"), hello("q")], "belongs to p")
    await refused(addr, ["[" * 100_000 + "]" * 100_000], "nested too deeply")
    await refused(addr, [hello(), {"have": {}, "load": float("nan")}], "NaN")
    async with daemon.client("x") as c:
        assert (await c.status())["host"] == "x"         # the daemon is unharmed
        assert await c.metric('peerd_have_frames_total{direction="received"}') == 4   # the valid hellos


async def test_news_of_a_chunk_the_version_does_not_have_closes_the_link(tmp_path, seaweed, keys, signed, checkpoint):
    m, doc = signed
    origin = await publish(seaweed, checkpoint, f"t/{uuid.uuid4().hex[:8]}")
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"], extra={"x": ["--origin-rate", "128K"]}).start()
    try:
        async with fleet.client("x") as c:
            await c.start_job(doc, origin, seeders=["x"])        # ~25 s of origin reads: still fetching below
            zeros = pack_bits(np.zeros(len(m.chunks), bool))
            await refused(fleet.procs["x"].addr, [hello("p", {m.digest: zeros}),
                                                  {"have": {m.digest: [len(m.chunks)]}, "load": 0}], "out of range")
            assert (await c.job(m.digest))["state"] == "fetching"
    finally:
        fleet.stop()


async def test_a_peer_without_have_links_is_pushed_to_over_http(tmp_path, seaweed, keys, signed, checkpoint):
    """An older peerd (here a stand-in that serves only POST /v1/gossip) joins x's swarm: x's link to
    it is refused with 404 at the upgrade, and x pushes to it with HTTP POSTs instead, as often as
    pushes go (not only on full gossip rounds, once a second)."""
    m, doc = signed
    origin = await publish(seaweed, checkpoint, f"t/{uuid.uuid4().hex[:8]}")
    port = free_ports(1)[0]
    me = {"id": "old", "addr": f"http://127.0.0.1:{port}", "rack": ""}
    zeros = pack_bits(np.zeros(len(m.chunks), bool))
    posts: list[float] = []

    async def gossip(request):
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        await request.json()
        posts.append(asyncio.get_running_loop().time())
        return web.json_response({"from": me, "versions": {m.digest: zeros}, "peers": [], "load": 0.0})

    app = web.Application()
    app.router.add_post("/v1/gossip", gossip)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"],
                  extra={"x": ["--origin-rate", "128K", "--peer", f"old={me['addr']}"]}).start()
    try:
        async with fleet.client("x") as c, aiohttp.ClientSession() as s:
            await c.start_job(doc, origin, seeders=["x"])
            async with s.post(fleet.procs["x"].addr + "/v1/gossip", headers=AUTH,      # 'old' joins x's swarm
                              json={"from": me, "versions": {m.digest: zeros}, "peers": [], "load": 0.0}) as r:
                assert r.status == 200
            t0 = asyncio.get_running_loop().time()
            await asyncio.sleep(3)
            recent = [t for t in posts if t > t0 + 1]                    # after the refused upgrade
            assert len(recent) >= 6, posts                               # pushes, not only 1 gossip round a second
            assert (await c.job(m.digest))["state"] == "fetching"
            assert await c.metric('peerd_have_frames_total{direction="sent"}') == 0
        assert "peer has no HAVE stream" in fleet.procs["x"].log_path.read_text()
    finally:
        fleet.stop()
        await runner.cleanup()


def test_a_peer_without_links_is_offered_one_again_later():
    """A peer that answered the upgrade with 404 gets HTTP pushes, and after RETRY_LINK_S a link again
    (it may have been upgraded since)."""
    links = HaveLinks(daemon=None)
    old = Member("old", "http://127.0.0.1:1", "")
    links.http_only["old"] = time.monotonic()
    assert links.get(old) is None
    links.http_only["old"] = time.monotonic() - RETRY_LINK_S - 1
    link = links.get(old)
    assert link is not None and link.fresh and "old" not in links.http_only
