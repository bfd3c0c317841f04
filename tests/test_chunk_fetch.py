"""peerd's chunk transport (peerd/chunk_fetch.py) against real sockets on loopback: a scripted peer
that answers as told (well, badly, slowly, or not at all), and a real peerd for the API it speaks."""
import asyncio
import os
import time

import pytest

from peerd.chunk_fetch import BadResponse, ChunkFetcher, PeerStatus, WrongLength
from peerd.ratelimit import TokenBucket

BODY = os.urandom(300_000)


class ScriptedPeer:
    """An HTTP/1.1 server whose answer to each request is ``script(n, path)`` (bytes to send, or a
    coroutine function taking the writer); it counts connections and requests."""

    def __init__(self, script):
        self.script, self.connections, self.requests, self.paths = script, 0, 0, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.addr = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.paths.append(head)
                self.requests += 1
                answer = self.script(self.requests, head)
                if callable(answer):
                    await answer(writer)
                else:
                    writer.write(answer)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes = BODY, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def status(code: int, message: str) -> bytes:
    body = ('{"error": "%s"}' % message).encode()
    return f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def fetcher(stall_after: float = 5.0, rate: float | None = None) -> ChunkFetcher:
    return ChunkFetcher({"Authorization": "Bearer t"}, TokenBucket(rate), stall_after)


async def test_chunks_arrive_in_place_on_one_kept_alive_connection():
    async with ScriptedPeer(lambda n, head: ok()) as peer:
        f = fetcher()
        buf = bytearray(len(BODY) + 100)
        for _ in range(5):
            view = memoryview(buf)[:len(BODY)]
            view[:] = bytes(len(BODY))
            await f.fetch(peer.addr, "/v1/versions/x/chunks/3", view)
            assert bytes(view) == BODY
        assert peer.requests == 5 and peer.connections == 1 and f.connections_opened == 1
        assert b"GET /v1/versions/x/chunks/3 HTTP/1.1\r\n" in peer.paths[0]
        assert b"Authorization: Bearer t\r\n" in peer.paths[0]
        assert buf[len(BODY):] == bytes(100)          # nothing past the chunk's view was written
        f.close()


async def test_error_statuses_carry_the_peers_message_and_keep_the_connection():
    answers = {1: status(404, "chunk 3 is not verified here yet"), 2: status(503, "upload slots full"),
               3: ok()}
    async with ScriptedPeer(lambda n, head: answers[n]) as peer:
        f = fetcher()
        view = memoryview(bytearray(len(BODY)))
        with pytest.raises(PeerStatus) as e:
            await f.fetch(peer.addr, "/c", view)
        assert e.value.status == 404 and "not verified" in e.value.message
        with pytest.raises(PeerStatus) as e:
            await f.fetch(peer.addr, "/c", view)
        assert e.value.status == 503
        await f.fetch(peer.addr, "/c", view)
        assert bytes(view) == BODY and peer.connections == 1
        f.close()


async def test_a_wrong_length_or_a_broken_head_is_refused():
    answers = {1: ok(BODY[:-1]), 2: b"SMTP ready\r\n\r\n",
               3: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", 4: ok()}
    async with ScriptedPeer(lambda n, head: answers[n]) as peer:
        f = fetcher()
        view = memoryview(bytearray(len(BODY)))
        with pytest.raises(WrongLength, match="announced"):
            await f.fetch(peer.addr, "/c", view)
        with pytest.raises(BadResponse, match="status line"):
            await f.fetch(peer.addr, "/c", view)
        with pytest.raises(BadResponse, match="Content-Length"):
            await f.fetch(peer.addr, "/c", view)
        await f.fetch(peer.addr, "/c", view)          # each broken answer cost its connection, not the fetcher
        assert bytes(view) == BODY and peer.connections == 4
        f.close()


async def test_a_kept_alive_connection_the_peer_closed_is_retried_once_on_a_fresh_one():
    async def answer_then_close(writer):
        writer.write(ok())
        await writer.drain()
        writer.close()             # a keep-alive timeout on the peer's side

    async with ScriptedPeer(lambda n, head: answer_then_close) as peer:
        f = fetcher()
        view = memoryview(bytearray(len(BODY)))
        await f.fetch(peer.addr, "/c", view)
        await asyncio.sleep(0.1)
        await f.fetch(peer.addr, "/c", view)
        assert bytes(view) == BODY and peer.requests == 2 and peer.connections == 2
        f.close()


async def test_a_silent_peer_is_given_up_after_stall_after():
    async def head_then_silence(writer):
        writer.write(ok()[:1000])
        await writer.drain()
        await asyncio.sleep(30)

    async with ScriptedPeer(lambda n, head: head_then_silence) as peer:
        f = fetcher(stall_after=0.5)
        view = memoryview(bytearray(len(BODY)))
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f.fetch(peer.addr, "/c", view), 20)
        assert time.monotonic() - t0 >= 0.5
        f.close()


async def test_a_cancelled_fetch_writes_nothing_more_into_the_buffer():
    """The buffer goes back to the pool after a cancel: no later byte from the socket may land in it."""
    async def trickle(writer):
        data = ok()
        writer.write(data[:50_000])
        await writer.drain()
        await asyncio.sleep(0.3)
        try:
            writer.write(data[50_000:])
            await writer.drain()
        except ConnectionError:
            pass

    async with ScriptedPeer(lambda n, head: trickle) as peer:
        f = fetcher()
        view = memoryview(bytearray(len(BODY)))
        task = asyncio.create_task(f.fetch(peer.addr, "/c", view))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        view[:] = bytes(len(BODY))
        await asyncio.sleep(0.5)                     # the rest of the body arrives at a closed socket
        assert bytes(view) == bytes(len(BODY))
        f.close()


async def test_a_download_rate_paces_the_reads():
    """1.2 MB at 2 MB/s (burst 0.1 MB) cannot arrive in less than ~0.55 s: a lower bound, never flaky."""
    body = os.urandom(1_200_000)
    async with ScriptedPeer(lambda n, head: ok(body)) as peer:
        f = fetcher(rate=2_000_000)
        view = memoryview(bytearray(len(body)))
        t0 = time.monotonic()
        await f.fetch(peer.addr, "/c", view)
        assert bytes(view) == body
        assert time.monotonic() - t0 >= (len(body) - f.bucket.burst) / 2_000_000
        f.close()


@pytest.mark.parametrize("size, rate", [(100_000, 2_000_000), (8_000, 200_000)])
async def test_a_download_rate_paces_chunks_smaller_than_a_paced_piece(size, rate):
    """Ten chunks, each received in one piece (100 kB), or with the response head in its first read
    (8 kB), at a rate whose burst is 5 % of a second: every chunk pays its bytes before it is done, so
    they take at least (10 x size - burst) / rate (a chunk's debt left for the next receive would never
    be paid: they came in at loopback speed)."""
    body = os.urandom(size)
    async with ScriptedPeer(lambda n, head: ok(body)) as peer:
        f = fetcher(rate=rate)
        t0 = time.monotonic()
        for _ in range(10):
            view = memoryview(bytearray(len(body)))
            await f.fetch(peer.addr, "/c", view)
            assert bytes(view) == body
        assert time.monotonic() - t0 >= (10 * len(body) - f.bucket.burst) / rate
        f.close()


async def test_an_unreachable_peer_is_an_os_error():
    f = fetcher()
    with pytest.raises(OSError):
        await f.fetch("http://127.0.0.1:1", "/c", memoryview(bytearray(10)))
    for addr in ("ftp://127.0.0.1:1", "http://127.0.0.1:99999", "http://:80"):
        with pytest.raises(BadResponse, match="not http"):
            await f.fetch(addr, "/c", memoryview(bytearray(10)))
    f.close()
