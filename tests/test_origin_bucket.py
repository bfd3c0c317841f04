"""``S3Origin.ensure_bucket`` against the real embedded S3 server: it creates, it tolerates a
concurrent creator (the race that weed mini's own ``-bucket`` start-up wins), and it names the
origin when it cannot reach it. And a read from an origin that never answers fails instead of holding
its caller."""
import asyncio
import uuid

import pytest

from peerd.origin import OriginError, OriginSpec, S3Origin
from lib.ports import free_ports
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY


async def _ensure(spec: OriginSpec) -> None:
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        await o.ensure_bucket()


async def test_concurrent_creators_all_succeed_and_the_bucket_is_usable(seaweed):
    spec = OriginSpec(seaweed.endpoint, f"race-{uuid.uuid4().hex[:8]}", "p")
    # eight clients HEAD (404) and CREATE at once: all but one CREATE lose with BucketAlreadyOwnedByYou
    await asyncio.gather(*[_ensure(spec) for _ in range(8)])
    await _ensure(spec)                                     # and again, now that it exists
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        await o.put_bytes(spec.key("x"), b"hello")
        assert await o.read_object("x") == b"hello"


async def test_an_unreachable_origin_is_an_origin_error_that_names_it():
    port = free_ports(1)[0]                                 # nothing listens there
    spec = OriginSpec(f"http://127.0.0.1:{port}", "weights", "p")
    with pytest.raises(OriginError, match=f"127.0.0.1:{port}"):
        await _ensure(spec)


async def test_a_read_from_an_origin_that_never_answers_fails_within_its_read_timeout():
    """A listener that accepts and then says nothing (a wedged S3 server): the read fails with an
    OriginError after the read timeout (each of botocore's attempts), and peerd asks for the chunk again."""
    held = []

    async def silent(reader, writer):
        held.append(writer)                                # keep the connection open, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        spec = OriginSpec(f"http://127.0.0.1:{port}", "weights", "p")
        async with S3Origin(spec, ACCESS_KEY, SECRET_KEY, read_timeout_s=0.3) as o:
            with pytest.raises(OriginError, match="origin read of f@0\\+4 failed"):
                # a bound on the wait, far above 3 x 0.3 s: botocore's own 60 s would run past it
                await asyncio.wait_for(o.read_range("f", 0, memoryview(bytearray(4))), 30)
        assert len(held) >= 1
    finally:
        for w in held:
            w.close()
        server.close()
