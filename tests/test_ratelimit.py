"""The token bucket's two classes of traffic, without sleeping: the waits it asks for are recorded."""
import pytest

from peerd import ratelimit
from peerd.ratelimit import TokenBucket


@pytest.fixture
def waits(monkeypatch):
    asked = []

    async def sleep(s):
        asked.append(s)
    monkeypatch.setattr(ratelimit.asyncio, "sleep", sleep)
    return asked


async def test_priority_bytes_never_wait_behind_a_peer_downloads_debt(waits):
    """An origin read (priority) on a host whose peer downloads put the bucket 1 s in debt waits only
    for its own bytes; the next peer download pays for both (the total rate holds)."""
    b = TokenBucket(1_000_000, burst=0)
    await b.acquire(1_000_000)                       # a peer chunk: 1 s of debt
    assert waits[-1] == pytest.approx(1.0, abs=0.02)
    await b.acquire(250_000, priority=True)          # an origin piece
    assert waits[-1] == pytest.approx(0.25, abs=0.02)
    await b.acquire(1)                               # the next peer download waits for all of it
    assert waits[-1] == pytest.approx(1.25, abs=0.02)


async def test_priority_bytes_alone_never_exceed_the_rate(waits):
    b = TokenBucket(1_000_000, burst=0)
    for _ in range(4):
        await b.acquire(500_000, priority=True)
    assert waits[-1] == pytest.approx(2.0, abs=0.02)   # 2 MB of origin reads: 2 s at 1 MB/s


async def test_no_rate_means_no_wait(waits):
    await TokenBucket(None).acquire(10**9)
    await TokenBucket(None).acquire(10**9, priority=True)
    assert waits == []


async def test_paced_pieces_follow_the_rate_and_unlimited_moves_all_at_once():
    whole = 64 << 20
    assert TokenBucket(None).piece(128 << 10, whole) == whole
    assert TokenBucket(8 << 20).piece(128 << 10, whole) == 128 << 10           # 4 ms of 8 MiB/s is less
    assert TokenBucket(1 << 30).piece(128 << 10, whole) == int((1 << 30) * ratelimit.PACE_S)
    assert TokenBucket(1 << 30).piece(128 << 10, 1000) == 1000                 # never past what is left


async def test_debt_is_what_a_pausing_reader_waits():
    b = TokenBucket(1_000_000, burst=0)
    assert b.debt(500_000) == pytest.approx(0.5, abs=0.02)
    assert b.debt(500_000) == pytest.approx(1.0, abs=0.02)    # readers pausing side by side share the rate
    assert TokenBucket(None).debt(10**9) == 0.0
