"""The chunk download path: ``GET /v1/versions/{vid}/chunks/{i}`` from a peer, the body received in
place into the caller's buffer.

This is the one HTTP request peerd makes thousands of times a second per fleet, so it skips the
general client and the event loop: each transfer runs in a worker thread on a kept-alive, blocking
HTTP/1.1 socket, and the body arrives with one ``recv_into(..., MSG_WAITALL)`` straight into the
chunk buffer it is hashed and written from (no pieces, no join, no readiness callbacks). The loop
thread only hands out work and sees one completion per chunk, so receiving scales over cores instead
of running every byte copy of the host through one thread (at 10 Gbit/s that copy alone is most of
a core). The wire is plain HTTP/1.1 with the cluster token, the API in docs/peerd.md: any HTTP
client can still fetch a chunk. aiohttp stays for everything else (gossip, manifests, jobs).

Time-outs match what aiohttp gave the job before: ``connect_timeout`` to connect, and a download that
receives nothing for ``stall_after`` seconds fails (a host that died mid-upload; ``SO_RCVTIMEO`` on
the socket); the clock stops while our own rate limit pauses reading. A cancelled fetch shuts its
socket down (a blocked receive returns at once) and returns only when its thread is done with the
caller's buffer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from peerd.ratelimit import TokenBucket

log = logging.getLogger("peerd.chunk_fetch")

MAX_HEAD = 16 * 1024          # a response head larger than this is refused
MAX_ERROR_BODY = 64 * 1024    # error bodies (JSON) are read up to this, for the message
PACED_PIECE = 256 * 1024      # with a download rate, a receive pays for about 4 ms of it at a time, at least this (a thread wake-up a piece: 64 KiB cost the 16-host swarm ~5 % more CPU)
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


@dataclass(frozen=True)
class Head:
    status: int
    length: int
    close_after: bool            # HTTP/1.0 or ``Connection: close``: the connection ends with this response


def parse_head(head: bytes, chunk_len: int) -> Head:
    """A response head (without the blank line) as the chunk path accepts it; pure, no I/O."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status, length, close_after = int(parts[1]), None, parts[0] == "HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip()
        if name == "content-length":
            length = int(value) if value.isdigit() else -1
        elif name == "connection" and value.lower() == "close":
            close_after = True
        elif name == "transfer-encoding":
            length = -1                         # our peers always send a length
    if length is None or length < 0:
        raise BadResponse(f"HTTP {status} without a usable Content-Length")
    if status == 200 and length != chunk_len:
        raise WrongLength(f"the peer announced {length} bytes for a {chunk_len}-byte chunk")
    return Head(status, length, close_after)


class _Conn:
    """One kept-alive connection: a blocking socket, used by one worker thread at a time."""

    def __init__(self, sock: socket.socket, stall_after: float):
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        if self.tls:             # TLS reads cannot take MSG_WAITALL: a Python-level time-out instead
            sock.settimeout(stall_after)
        else:
            sock.settimeout(None)
            tv = struct.pack("ll", int(stall_after), int((stall_after % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.stall_after = stall_after
        self.closed = False
        self.idle_since = time.monotonic()
        self.head = bytearray(MAX_HEAD)

    def abort(self) -> None:
        """Stop at once: a receive blocked in another thread returns; the socket is closed by its user."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class _Transfer:
    """One request and its response on one connection, run in a worker thread (``run``)."""

    def __init__(self, conn: _Conn, raw: bytes, into: memoryview, bucket: TokenBucket):
        self.conn, self.raw, self.into, self.bucket = conn, raw, into, bucket
        self.got_any = False        # some of the response arrived (a GET that got nothing may be retried)
        self.complete = False       # the response was read to its end: the connection may be kept
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()
        self.conn.abort()

    def run(self) -> None:
        conn = self.conn
        try:
            conn.sock.sendall(self.raw)
            head, rest = self._read_head()
            h = parse_head(head, len(self.into))
            body = self.into if h.status == 200 else None
            if body is None and h.length > MAX_ERROR_BODY:
                raise PeerStatus(h.status, f"(error body of {h.length} bytes not read)")  # connection dropped
            if len(rest) > h.length:
                raise BadResponse("the peer sent more than its Content-Length")
            if body is None:
                body = memoryview(bytearray(h.length))
            body[:len(rest)] = rest
            self._pay(len(rest))
            self._read_body(body, len(rest))
            self.complete = not h.close_after
            if h.status != 200:
                raise PeerStatus(h.status, _error_text(bytes(body)))
        except BlockingIOError:          # SO_RCVTIMEO / SO_SNDTIMEO ran out
            raise asyncio.TimeoutError(f"nothing received for {conn.stall_after:g} s") from None
        except socket.timeout:           # TLS sockets time out in Python
            raise asyncio.TimeoutError(f"nothing received for {conn.stall_after:g} s") from None
        except OSError:
            if self.aborted.is_set():
                raise ConnectionAbortedError("the fetch was cancelled") from None
            raise
        finally:
            if not self.complete:
                conn.closed = True
                conn.sock.close()        # only the thread that used it closes it: no fd reused under a reader
            self.into = None

    def _recv(self, view: memoryview, waitall: bool) -> int:
        n = self.conn.sock.recv_into(view, len(view), socket.MSG_WAITALL if waitall and not self.conn.tls else 0)
        if n == 0:
            raise ConnectionResetError("the peer closed the connection"
                                       + (" (cancelled)" if self.aborted.is_set() else ""))
        self.got_any = True
        return n

    def _read_head(self) -> tuple[bytes, memoryview]:
        buf, n = self.conn.head, 0
        while True:
            if n >= MAX_HEAD:
                raise BadResponse(f"response head over {MAX_HEAD} bytes")
            n += self._recv(memoryview(buf)[n:], waitall=False)
            end = buf.find(b"\r\n\r\n", 0, n)
            if end >= 0:
                return bytes(buf[:end]), memoryview(buf)[end + 4:n]

    def _read_body(self, body: memoryview, pos: int) -> None:
        want = len(body)
        while pos < want:
            if self.aborted.is_set():
                raise ConnectionAbortedError("the fetch was cancelled")
            n = self._recv(body[pos:pos + self.bucket.piece(PACED_PIECE, want - pos)], waitall=True)
            pos += n
            self._pay(n)

    def _pay(self, n: int) -> None:
        """Charge ``n`` received bytes to the download rate and sleep out the debt now, for every piece
        (the last one, and body bytes that came with the head, too): a debt left for the next receive
        is never paid when a chunk is one piece, since every receive starts before its charge."""
        wait = self.bucket.debt(n)
        if wait > 0 and self.aborted.wait(wait):
            raise ConnectionAbortedError("the fetch was cancelled")


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", ""))[:500]
    except (ValueError, AttributeError):
        return body[:500].decode("utf-8", "replace")


class ChunkFetcher:
    """Kept-alive chunk connections to each peer, and the request that fills a caller's buffer.

    ``max_transfers`` worker threads receive at once (more fetches queue for a thread; a queued one
    has not sent its request, so no stall clock runs): size it to the requests a host keeps in flight.
    """

    def __init__(self, headers: dict, bucket: TokenBucket, stall_after: float,
                 connect_timeout: float = 3.0, max_idle_per_peer: int = 16, max_transfers: int = 32):
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.bucket, self.stall_after = bucket, stall_after
        self.connect_timeout, self.max_idle = connect_timeout, max_idle_per_peer
        self._idle: dict[str, list[_Conn]] = {}
        self._busy: set[_Transfer] = set()
        self._threads = ThreadPoolExecutor(max_transfers, thread_name_prefix="chunk-rx")
        self.connections_opened = 0

    async def fetch(self, addr: str, path: str, into: memoryview) -> None:
        """Fill ``into`` with the body of ``GET addr+path`` (exactly ``len(into)`` bytes, status 200).

        Raises ``PeerStatus`` (the peer answered another status), ``BadResponse`` (protocol broken,
        wrong length), ``asyncio.TimeoutError`` (connect or stall) or ``OSError`` (network). Returns,
        also when cancelled, only once nothing can write into ``into`` any more.
        """
        url = urlsplit(addr)
        raw = (f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n{self._headers}\r\n").encode()
        for attempt in (0, 1):
            conn, reused = await self._checkout(addr, url)
            t = _Transfer(conn, raw, into, self.bucket)
            self._busy.add(t)
            try:
                await _until_done(asyncio.get_running_loop().run_in_executor(self._threads, t.run), t.abort)
            except (ConnectionResetError, BrokenPipeError):
                # a kept-alive connection the peer had just closed: try once more on a fresh one,
                # but only when nothing of the response arrived (a GET is safe to repeat)
                if reused and not t.got_any and attempt == 0:
                    continue
                raise
            finally:
                self._busy.discard(t)
                self._release(addr, conn)
            return

    def _release(self, addr: str, conn: _Conn) -> None:
        """A connection whose response was read to its end waits for the next request to its peer."""
        if conn.closed:
            return
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    async def _checkout(self, addr: str, url) -> tuple[_Conn, bool]:
        idle = self._idle.get(addr, [])
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn, True
            conn.close()
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:          # a port out of range: gossip's address check lets digits through
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise BadResponse(f"peer address {addr!r} is not http(s)://host:port")
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout + 1):        # wait_for could drop a cancel (peerd/job.py)
            sock = await loop.run_in_executor(
                self._threads, _connect, url.hostname, port, url.scheme == "https", self.connect_timeout)
        self.connections_opened += 1
        return _Conn(sock, self.stall_after), False

    def close_idle(self) -> None:
        """Close connections idle for longer than ``IDLE_S`` (the daemon's sweep calls this)."""
        now = time.monotonic()
        for addr, conns in list(self._idle.items()):
            keep = [c for c in conns if not c.closed and now - c.idle_since < IDLE_S]
            for c in conns:
                if c not in keep:
                    c.close()
            if keep:
                self._idle[addr] = keep
            else:
                del self._idle[addr]

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        for t in list(self._busy):
            t.abort()
        self._threads.shutdown(wait=False)


def _connect(host: str, port: int, tls: bool, timeout: float) -> socket.socket:
    """A blocking connect in a worker thread (name lookup included), within ``timeout``."""
    sock = socket.create_connection((host, port), timeout=timeout)
    if tls:
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    return sock


async def _until_done(fut: asyncio.Future, abort) -> None:
    """Await a worker thread's future; a cancel aborts the work and still waits for the thread to
    finish (the caller's buffer is in its hands until then), then re-raises the cancel."""
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        abort()
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                continue
        if not fut.cancelled():
            fut.exception()          # retrieved: the cancel is what the caller sees
        raise
