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


def test_a_member_is_judged_dead_from_the_first_time_it_was_gossiped_to():
    """A member known from the seed list but never tried is not declared dead for silence (in a fleet
    started together it may just not have been reached); once gossiped to, silence for dead_after is."""
    clock = Clock()
    m = Membership(peer(0), dead_after=5, clock=clock)
    m.learn(peer(1))
    m.learn(peer(2))
    clock.t += 60
    assert m.sweep() == []
    assert [t.id for t in m.gossip_targets(0, set(), probe={"h1"})] == ["h1"]
    clock.t += 5.1
    assert [x.id for x in m.sweep()] == ["h1"]               # tried, and silent since
    m.heard_from(peer(1), {})
    assert not m.members["h1"].dead and m.sweep() == []


def test_fellow_seeders_are_probed_even_when_believed_dead():
    """A seeder gossips to every other seeder each full round, dead or not: one wrongly believed dead
    has its origin stripe read again by the others until it is heard from."""
    clock = Clock()
    m = Membership(peer(0), dead_after=5, clock=clock)
    for i in (1, 2, 3):
        m.heard_from(peer(i), {})
    m.mark_dead("h1")
    assert {t.id for t in m.gossip_targets(0, set(), probe={"h1", "h2"})} == {"h1", "h2"}
    assert {t.id for t in m.gossip_targets(0, {"h1", "h2"})} == {"h2"}     # 'always' names the living only
    assert len(m.gossip_targets(1, set(), probe={"h1"})) == 2             # plus one random live member
