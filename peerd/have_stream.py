"""HAVE streams: one persistent, authenticated websocket per peer in the active swarm.

While a host downloads, it tells every active peer about each chunk it verifies (every hop of every
chunk waits for that news). As an HTTP POST with a full gossip message each way that exchange costs
about three times the CPU it costs on a link (`weightcast bench gossip`; docs/peerd.md, "HAVE
links"), where it is two small frames: the sender's *news* (the chunk ids it verified since its last
frame on this link, and its upload load) and the receiver's reply (the same, from its side). A link opens with full gossip messages both ways
and carries one again on every full gossip round, which also repairs what news cannot say (a chunk
withdrawn as corrupt on disk). Frames are JSON text: a full message is exactly ``POST /v1/gossip``'s
body; news is ``{"have": {vid: [chunk, ...]}, "load": x}``. A peer that does not offer ``/v1/have``
(an older peerd) is gossiped with over HTTP.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from lib.http_input import BadInput, parse_json
from peerd.wire import MAX_GOSSIP_BYTES, WireError, check_gossip, check_have

log = logging.getLogger("peerd.have")

PATH = "/v1/have"
FRAME_TIMEOUT_S = 3.0      # an exchange not answered in this long closes the link (as the HTTP push's timeout)
LINK_IDLE_S = 30.0         # a link unused this long is closed: the swarm moved on
SERVE_IDLE_S = 120.0       # the serving side closes a link silent this long (a client that vanished)
RETRY_LINK_S = 300.0       # a peer that had no HAVE stream is offered a link again after this (upgraded since?)
_POLICY_VIOLATION = 1008   # websocket close code for a frame that breaks the protocol (an HTTP 400's kin)


class NewsCursor:
    """Which of this host's verified chunks one link has told its far side, per version.

    ``VersionStore.news`` lists chunks in the order this process verified them; a cursor remembers
    how far into each list it has sent. A version removed and fetched again is a new store object,
    so its news restarts from the beginning."""

    def __init__(self):
        self._at: dict[str, tuple[object, int]] = {}

    def told_all(self, store) -> None:
        """A full message (every bit) just went out: everything verified so far is told."""
        self._at = {vid: (vs, len(vs.news)) for vid, vs in store.versions.items()}

    def news(self, store) -> dict[str, list[int]]:
        out = {}
        for vid, vs in store.versions.items():
            obj, n = self._at.get(vid, (None, 0))
            start = n if obj is vs else 0
            if len(vs.news) > start:
                out[vid] = vs.news[start:]
            self._at[vid] = (vs, len(vs.news))
        return out


def news_frame(daemon, cursor: NewsCursor) -> str:
    return json.dumps({"have": cursor.news(daemon.store), "load": daemon.upload_load()})


def absorb_frame(daemon, text: str, peer_id: str | None) -> tuple[str, bool]:
    """Apply one frame from ``peer_id`` (None before the link's first full message); returns the
    sender's id and whether the frame was a full message. Raises WireError for a frame that breaks
    the protocol."""
    try:
        body = parse_json(text)          # the HTTP API's strict parser: no NaN, bounded nesting
    except BadInput as e:
        raise WireError(f"a HAVE frame must be a JSON object: {e}") from None
    if isinstance(body, dict) and "have" in body:
        if peer_id is None:
            raise WireError("a link's first frame must be a full gossip message (from, versions, peers, load)")
        daemon.absorb_have(peer_id, check_have(body))
        return peer_id, False
    msg = check_gossip(body)
    if peer_id is not None and msg["from"]["id"] != peer_id:
        raise WireError(f"this link belongs to {peer_id}; a frame from {msg['from']['id']} does not")
    daemon.absorb_gossip(msg)
    return msg["from"]["id"], True


class Link:
    """This host's side of one outbound link: the websocket (opened on first use) and its cursor."""

    def __init__(self, member):
        self.member = member
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.cursor = NewsCursor()
        self.used = time.monotonic()

    @property
    def fresh(self) -> bool:
        return self.ws is None or self.ws.closed


class HaveLinks:
    """The outbound links of one daemon, keyed by member id."""

    def __init__(self, daemon):
        self.d = daemon
        self.links: dict[str, Link] = {}
        self.http_only: dict[str, float] = {}   # members whose peerd had no HAVE stream (404), and since when
        self.served: set[web.WebSocketResponse] = set()   # inbound links, closed on shutdown
        self._closing: set[asyncio.Task] = set()           # closes in progress (a task nobody holds may vanish)

    def get(self, member) -> Link | None:
        """The link to ``member``; None when it speaks only HTTP gossip."""
        since = self.http_only.get(member.id)
        if since is not None:
            if time.monotonic() - since < RETRY_LINK_S:
                return None
            del self.http_only[member.id]
        link = self.links.get(member.id)
        if link is not None and link.member.addr != member.addr:
            self.drop(member.id)             # it moved: a link to the old address is of no use
            link = None
        if link is None:
            link = self.links[member.id] = Link(member)
        return link

    async def exchange(self, link: Link, frame: str, full: bool) -> None:
        """Send one frame (``full``: a full gossip message, else news) and absorb the reply. A link
        opens only to carry a full message; when it cannot open because the member has no HAVE
        stream, that message goes as an HTTP exchange instead. Any other failure closes the link (the
        next round opens a fresh one, starting with a full message)."""
        d, m = self.d, link.member
        link.used = time.monotonic()
        if link.fresh and not full:      # it closed since the round was planned: news would start it wrong
            self.drop(m.id)
            return
        try:
            if link.fresh:
                link.ws = await d.http.ws_connect(f"{m.addr}{PATH}", headers=d.auth_headers(),
                                                  max_msg_size=MAX_GOSSIP_BYTES, autoping=True)
                self.set_gauges()
            await link.ws.send_str(frame)
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                reply = await link.ws.receive()
            if reply.type != aiohttp.WSMsgType.TEXT:
                raise ConnectionError(f"link closed ({reply.type.name}, {reply.extra or link.ws.close_code})")
            absorb_frame(d, reply.data, m.id)
            d.metrics.gossip.labels("sent").inc()
            d.metrics.have_frames.labels("sent").inc()
        except aiohttp.WSServerHandshakeError as e:
            self.drop(m.id)
            if e.status in (404, 405):
                self.http_only[m.id] = time.monotonic()
                log.info("peer has no HAVE stream; gossiping over HTTP", extra={"peer": m.id})
                await d.gossip_over_http(m, frame.encode())
            else:
                log.info("HAVE link refused", extra={"peer": m.id, "status": e.status})
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, WireError) as e:
            log.debug("HAVE link to %s closed: %s", m.id, e)
            self.drop(m.id)

    def drop(self, member_id: str) -> None:
        link = self.links.pop(member_id, None)
        if link is not None and link.ws is not None and not link.ws.closed:
            t = asyncio.ensure_future(link.ws.close())
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)
        self.set_gauges()

    def set_gauges(self) -> None:
        self.d.metrics.have_links.labels("out").set(sum(1 for lk in self.links.values() if not lk.fresh))
        self.d.metrics.have_links.labels("in").set(len(self.served))

    def close_idle(self, now: float) -> None:
        for mid in [mid for mid, link in self.links.items() if now - link.used > LINK_IDLE_S]:
            self.drop(mid)

    async def close(self) -> None:
        for link in self.links.values():
            if link.ws is not None:
                await link.ws.close()
        self.links.clear()
        for ws in list(self.served):
            await ws.close()


async def serve(daemon, request: web.Request) -> web.WebSocketResponse:
    """``GET /v1/have`` (authenticated by the API's token check before the upgrade): answer each frame
    with this host's own, until the link closes, idles out, or breaks the protocol."""
    ws = web.WebSocketResponse(max_msg_size=MAX_GOSSIP_BYTES)
    await ws.prepare(request)
    peer_id, cursor = None, NewsCursor()
    daemon.have_links.served.add(ws)
    daemon.have_links.set_gauges()
    try:
        while True:
            msg = await ws.receive(timeout=SERVE_IDLE_S)
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):
                break
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise WireError("HAVE frames are JSON text")
            peer_id, full = absorb_frame(daemon, msg.data, peer_id)
            daemon.metrics.gossip.labels("received").inc()
            daemon.metrics.have_frames.labels("received").inc()
            if full:
                reply = json.dumps(daemon.gossip_message())
                cursor.told_all(daemon.store)
            else:
                reply = news_frame(daemon, cursor)
            await ws.send_str(reply)
    except WireError as e:
        log.info("HAVE link closed: bad frame", extra={"peer": peer_id, "error": str(e)})
        await ws.close(code=_POLICY_VIOLATION, message=str(e)[:120].encode())
    except asyncio.TimeoutError:
        await ws.close()
    except ConnectionError as e:
        log.debug("HAVE link from %s broke: %s", peer_id, e)
    finally:
        daemon.have_links.served.discard(ws)
        daemon.have_links.set_gauges()
    return ws
