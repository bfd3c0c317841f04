"""Membership on its own (fake clock): hearsay sampling stays cheap and catches up within POOL_TTL."""
from peerd.membership import POOL_TTL, Membership


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def peer(i):
    return {"id": f"h{i}", "addr": f"http://127.0.0.1:{i}", "rack": ""}


def test_hearsay_comes_from_a_pool_rebuilt_at_most_every_pool_ttl():
    clock = Clock()
    m = Membership(peer(0), dead_after=5, clock=clock)
    for i in range(1, 4):
        m.heard_from(peer(i), {})
    assert {p["id"] for p in m.sample_peers(8)} == {"h1", "h2", "h3"}   # never me, never more than there are
    m.heard_from(peer(4), {})
    m.mark_dead("h1")
    assert {p["id"] for p in m.sample_peers(8)} == {"h1", "h2", "h3"}   # within POOL_TTL: the old pool
    clock.t += POOL_TTL
    assert {p["id"] for p in m.sample_peers(8)} == {"h2", "h3", "h4"}   # then the living, as they are now
    assert len(m.sample_peers(2)) == 2
