"""``S3Origin.ensure_bucket`` against the real embedded S3 server: it creates, it tolerates a
concurrent creator (the race that weed mini's own ``-bucket`` start-up wins), and it names the
origin when it cannot reach it."""
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
