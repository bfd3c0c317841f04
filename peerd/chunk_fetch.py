"""The chunk download path: ``GET /v1/versions/{vid}/chunks/{i}`` from a peer, the body received in
place into the caller's buffer.

This is the one HTTP request peerd makes thousands of times a second per fleet, so it skips the
general client: each kept-alive HTTP/1.1 connection is an ``asyncio.BufferedProtocol`` whose
``get_buffer`` hands the socket the free tail of the chunk buffer, so the kernel copies the bytes
once, straight to where they are hashed and written from (no pieces, no join, no stream reader).
The wire is plain HTTP/1.1 with the cluster token, the API in docs/peerd.md: any HTTP client can
still fetch a chunk. aiohttp stays for everything else (gossip, manifests, jobs).

Time-outs match what aiohttp gave the job before: ``connect_timeout`` to connect, and a download that
receives nothing for ``stall_after`` seconds fails (a host that died mid-upload); the clock stops
while our own rate limit pauses reading.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from urllib.parse import urlsplit

from peerd.ratelimit import TokenBucket

log = logging.getLogger("peerd.chunk_fetch")

MAX_HEAD = 16 * 1024          # a response head larger than this is refused
MAX_ERROR_BODY = 64 * 1024    # error bodies (JSON) are read up to this, for the message
PACED_PIECE = 64 * 1024       # with a download rate, bytes are paid for in pieces of about 4 ms, at least this
IDLE_S = 30.0                 # idle kept-alive connections are closed after this (the server keeps 75 s)


class PeerStatus(Exception):
    """The peer answered with a status other than 200; ``message`` is its error text."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class BadResponse(Exception):
    """The peer's response breaks the protocol (a malformed head): not a network error."""


class WrongLength(BadResponse):
    """A 200 whose length is not the chunk's: the peer serves bytes that cannot match the manifest."""


class _Conn(asyncio.BufferedProtocol):
    """One connection; at most one response in flight on it."""

    def __init__(self, bucket: TokenBucket, stall_after: float):
        self.bucket, self.stall_after = bucket, stall_after
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._head = bytearray(MAX_HEAD)
        self._head_len = 0
        self._into: memoryview | None = None     # the caller's chunk buffer
        self._body: memoryview | None = None     # where the body goes (the chunk, or an error scratch)
        self._pos = 0
        self._want = 0
        self._status = 0
        self._close_after = False
        self._done: asyncio.Future | None = None
        self._last = 0.0                         # loop time of the last bytes received (stall clock)
        self._paused = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._got_any = False
        self._complete = False                   # the current response was read to its end

    # -------------------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._fail(ConnectionResetError(f"the peer closed the connection{f': {exc}' if exc else ''}"))

    def eof_received(self):
        return False                                # close our side too

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is None:                     # reading the head (or a stray byte between responses)
            return memoryview(self._head)[self._head_len:] if self._head_len < MAX_HEAD else memoryview(self._head)
        return self._body[self._pos:self._pos + self.bucket.piece(PACED_PIECE, self._want - self._pos)]

    def buffer_updated(self, nbytes: int) -> None:
        if self._done is None or self._done.done():  # bytes nobody asked for: the connection is unusable
            self._abort()
            return
        self._got_any = True
        self._last = asyncio.get_running_loop().time()
        if self._body is None:
            self._head_len += nbytes
            self._parse_head()
            return
        self._pos += nbytes
        wait = self.bucket.debt(nbytes)           # paid as received; the last piece's debt carries over
        if self._pos == self._want:
            self._finish()
        elif wait > 0:
            self._pause(wait)

    # -------------------------------------------------------------------------- one request
    async def request(self, raw_request: bytes, into: memoryview) -> None:
        loop = asyncio.get_running_loop()
        self._into = into
        self._head_len = self._pos = self._want = self._status = 0
        self._body, self._got_any, self._complete = None, False, False
        self._done = loop.create_future()
        self._last = loop.time()
        self._watchdog = loop.call_later(self.stall_after, self._check_stall)
        try:
            self.transport.write(raw_request)
            await self._done
        except PeerStatus:
            if not self._complete:
                self._abort()
            raise                  # a whole error response: the connection stays usable
        except BaseException:
            self._abort()          # cancelled or failed mid-response: the connection cannot be reused
            raise
        finally:
            self._watchdog.cancel()
            self._body, self._into = None, None     # nothing may land in the caller's buffer from now on

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n", 0, self._head_len)
        if end < 0:
            if self._head_len >= MAX_HEAD:
                self._fail(BadResponse(f"response head over {MAX_HEAD} bytes"))
            return
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            self._fail(BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}"))
            return
        self._status = int(parts[1])
        length, self._close_after = None, parts[0] == "HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                length = int(value) if value.isdigit() else -1
            elif name == "connection" and value.lower() == "close":
                self._close_after = True
            elif name == "transfer-encoding":
                length = -1                         # our peers always send a length
        if length is None or length < 0:
            self._fail(BadResponse(f"HTTP {self._status} without a usable Content-Length"))
            return
        if self._status == 200:
            if length != len(self._into):
                self._fail(WrongLength(f"the peer announced {length} bytes for a {len(self._into)}-byte chunk"))
                return
            self._body = self._into
        else:
            if length > MAX_ERROR_BODY:
                self._fail(PeerStatus(self._status, f"(error body of {length} bytes not read)"))   # connection dropped
                return
            self._body = memoryview(bytearray(length))
        self._want = length
        rest = self._head_len - end - 4               # body bytes that came with the head
        if rest > length:
            self._fail(BadResponse("the peer sent more than its Content-Length"))
            return
        self._body[:rest] = self._head[end + 4:self._head_len]
        self._pos = rest
        self.bucket.debt(rest)
        if self._pos == self._want:
            self._finish()

    def _finish(self) -> None:
        self._complete = True
        body, self._body = self._body, None        # later bytes are not this response's
        if self._status == 200:
            self._done.set_result(None)
        else:
            self._done.set_exception(PeerStatus(self._status, _error_text(bytes(body))))
        if self._close_after:
            self._abort()
        self.idle_since = time.monotonic()

    # -------------------------------------------------------------------------- pacing and stalls
    def _pause(self, wait: float) -> None:
        self._paused = True
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(wait, self._resume)

    def _resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self._last = asyncio.get_running_loop().time()   # our own pause is not the peer's stall
            self.transport.resume_reading()

    def _check_stall(self) -> None:
        if self._done is None or self._done.done():
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last
        if self._paused or idle < self.stall_after:
            self._watchdog = loop.call_later(self.stall_after - (0 if self._paused else idle), self._check_stall)
            return
        self._fail(asyncio.TimeoutError(f"nothing received for {self.stall_after:g} s"))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()      # stops reading at once: no later byte lands in a buffer


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", ""))[:500]
    except (ValueError, AttributeError):
        return body[:500].decode("utf-8", "replace")


class ChunkFetcher:
    """Kept-alive chunk connections to each peer, and the request that fills a caller's buffer."""

    def __init__(self, headers: dict, bucket: TokenBucket, stall_after: float,
                 connect_timeout: float = 3.0, max_idle_per_peer: int = 16):
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.bucket, self.stall_after = bucket, stall_after
        self.connect_timeout, self.max_idle = connect_timeout, max_idle_per_peer
        self._idle: dict[str, list[_Conn]] = {}
        self._busy: set[_Conn] = set()
        self.connections_opened = 0

    async def fetch(self, addr: str, path: str, into: memoryview) -> None:
        """Fill ``into`` with the body of ``GET addr+path`` (exactly ``len(into)`` bytes, status 200).

        Raises ``PeerStatus`` (the peer answered another status), ``BadResponse`` (protocol broken,
        wrong length), ``asyncio.TimeoutError`` (connect or stall) or ``OSError`` (network).
        """
        url = urlsplit(addr)
        raw = (f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n{self._headers}\r\n").encode()
        for attempt in (0, 1):
            conn, reused = await self._checkout(addr, url)
            self._busy.add(conn)
            try:
                await conn.request(raw, into)
            except ConnectionResetError:
                # a kept-alive connection the peer had just closed: try once more on a fresh one,
                # but only when nothing of the response arrived (a GET is safe to repeat)
                if reused and not conn._got_any and attempt == 0:
                    continue
                raise
            finally:
                self._busy.discard(conn)
                self._release(addr, conn)
            return

    def _release(self, addr: str, conn: _Conn) -> None:
        """A connection whose response was read to its end waits for the next request to its peer."""
        if conn.closed:
            return
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn._abort()

    async def _checkout(self, addr: str, url) -> tuple[_Conn, bool]:
        idle = self._idle.get(addr, [])
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn, True
            conn._abort()
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:          # a port out of range: gossip's address check lets digits through
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise BadResponse(f"peer address {addr!r} is not http(s)://host:port")
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(
            lambda: _Conn(self.bucket, self.stall_after), url.hostname, port,
            ssl=ssl.create_default_context() if url.scheme == "https" else None), self.connect_timeout)
        self.connections_opened += 1
        return conn, False

    def close_idle(self) -> None:
        """Close connections idle for longer than ``IDLE_S`` (the daemon's sweep calls this)."""
        now = time.monotonic()
        for addr, conns in list(self._idle.items()):
            keep = [c for c in conns if not c.closed and now - c.idle_since < IDLE_S]
            for c in conns:
                if c not in keep:
                    c._abort()
            if keep:
                self._idle[addr] = keep
            else:
                del self._idle[addr]

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c._abort()
        self._idle.clear()
        for c in list(self._busy):
            c._abort()
