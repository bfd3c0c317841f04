"""The swarm policy on its own: no sockets, no clock, seeded randomness."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.policy import ORIGIN, Cancel, PolicyConfig, Request, SwarmPolicy


def bits(n, idx):
    b = np.zeros(n, bool)
    b[list(idx)] = True
    return b


def pol(n=10, **kw):
    cfg = kw.pop("config", PolicyConfig(random_first=0))
    return SwarmPolicy(me="me", n_chunks=n, config=cfg, **kw)


def test_rarest_first():
    p = pol(4, config=PolicyConfig(random_first=0, max_inflight=1, peer_catch_up=0))
    p.peer_bitmap("a", bits(4, [0, 1, 2]), 0)
    p.peer_bitmap("b", bits(4, [0, 1]), 0)
    p.peer_bitmap("c", bits(4, [0]), 0)
    assert p.next_requests(0) == [Request(2, "a")]   # chunk 2 is held by one peer only


def test_rarity_counts_only_holders_this_host_may_ask():
    # me (rank 1 of the sorted members m2, me) imports the odd chunks; the even ones come from inside
    # the rack. "far" (r2) holds everything, "near" (r1) chunks 0 and 1. Usable holders: chunk 0 one
    # (near; far is not usable for it), 1 two, 2 none, 3 one (far: importer). Counting every holder,
    # chunk 0 would tie with chunk 1.
    for seed in range(10):
        p = pol(4, rack="r1", rack_members=("me", "m2"), seed=seed,
                config=PolicyConfig(random_first=0, max_inflight=2, max_per_peer=2, rack_grace_s=5, peer_catch_up=0))
        p.peer_bitmap("far", np.ones(4, bool), 0, rack="r2")
        p.peer_bitmap("near", bits(4, [0, 1]), 0, rack="r1")
        assert {(r.chunk, r.source) for r in p.next_requests(0)} == {(0, "near"), (3, "far")}


def test_random_first_then_rarest_and_seeded_determinism():
    def run(seed):
        p = pol(50, config=PolicyConfig(random_first=2, max_inflight=1), seed=seed)
        p.peer_bitmap("a", np.ones(50, bool), 0)
        return p.next_requests(0)[0].chunk
    firsts = {run(s) for s in range(20)}
    assert len(firsts) > 5                      # random among equals
    assert run(3) == run(3)                     # and reproducible


def test_caps_per_host_and_per_peer():
    p = pol(20, config=PolicyConfig(random_first=0, max_inflight=5, max_per_peer=2))
    for peer in ("a", "b"):
        p.peer_bitmap(peer, np.ones(20, bool), 0)
    reqs = p.next_requests(0)
    assert len(reqs) == 4                       # 2 peers x 2 per peer < 5 per host
    assert {r.source for r in reqs} == {"a", "b"}
    assert p.next_requests(0) == []
    p.chunk_done(reqs[0].chunk, reqs[0].source, 100, 0.1, 0.1)
    again = p.next_requests(0.1)
    assert len(again) == 1 and again[0].source == reqs[0].source
    assert not any(r.chunk in {x.chunk for x in reqs} for r in again)


def test_same_rack_preferred_and_cross_rack_striped():
    p = pol(8, rack="r1", rack_members=("me", "m2"), config=PolicyConfig(random_first=0, max_inflight=8,
                                                                           max_per_peer=8, rack_grace_s=5))
    p.peer_bitmap("far", np.ones(8, bool), 0, rack="r2")
    p.peer_bitmap("near", bits(8, [0]), 0, rack="r1")
    reqs = {r.chunk: r.source for r in p.next_requests(0)}
    assert reqs[0] == "near"
    # of the rest, only the chunks this host imports come cross-rack now: the rack's members sorted are
    # (m2, me), so "me" is rank 1 and imports the odd chunks
    assert set(reqs) - {0} == {1, 3, 5, 7}
    later = {r.chunk for r in p.next_requests(6)}       # after the grace, the rest too
    assert later == set(range(1, 8)) - set(reqs)


def test_each_chunk_crosses_into_a_rack_through_its_importer_then_its_backup_then_a_widening_few():
    members = ("me", "x2", "x3", "x4")          # me is rank 0: importer of c % 4 == 0, backup of c % 4 == 2
    p = pol(16, rack="r1", rack_members=members,
            config=PolicyConfig(random_first=0, max_inflight=16, max_per_peer=16, rack_grace_s=2, rack_rescue_s=10))
    p.peer_bitmap("far", np.ones(16, bool), 0, rack="r2")
    now = {r.chunk for r in p.next_requests(0)}
    assert now == {c for c in range(16) if c % 4 == 0}
    grace = {r.chunk for r in p.next_requests(3)}
    assert grace == {c for c in range(16) if c % 4 == 2}
    assert p.next_requests(9) == []            # the other two ranks' chunks come from inside the rack ...
    # ... unless nobody there has them by the rescue: then 2, 4, ... members may, doubling every grace
    # (me is 1 step from the importer of c % 4 == 3, 3 steps from that of c % 4 == 1)
    assert {r.chunk for r in p.next_requests(11)} == {c for c in range(16) if c % 4 == 3}
    assert {r.chunk for r in p.next_requests(13)} == {c for c in range(16) if c % 4 == 1}


def test_a_full_uploader_is_not_asked_and_the_less_loaded_holder_is_preferred():
    def first_source(seed, calm_load):
        p = pol(2, config=PolicyConfig(random_first=0, max_inflight=1), seed=seed)
        p.peer_bitmap("full", np.ones(2, bool), 0, load=1.0)
        p.peer_bitmap("busy", np.ones(2, bool), 0, load=0.875)
        p.peer_bitmap("calm", np.ones(2, bool), 0, load=calm_load)
        return p.next_requests(0)[0].source
    picks = [first_source(s, 0.0) for s in range(60)]
    assert "full" not in picks                  # it would answer busy
    assert picks.count("calm") >= 45
    assert {first_source(s, 0.875) for s in range(30)} == {"calm", "busy"}   # equal loads: either


def test_a_peer_reporting_room_again_is_asked_again():
    p = pol(2, config=PolicyConfig(random_first=0, max_inflight=1, peer_catch_up=0))
    p.peer_bitmap("a", np.ones(2, bool), 0, load=1.0)
    assert p.next_requests(0) == []
    p.peer_has("a", [], 0.1, load=0.5)          # its next push says it has room
    assert [r.source for r in p.next_requests(0.1)] == ["a"]


def test_origin_only_for_own_stripe_and_only_when_no_peer_has_it():
    p = pol(6, seeders=("me", "s2"), config=PolicyConfig(random_first=0, max_inflight=6, origin_inflight=6))
    p.peer_bitmap("s2", bits(6, [0]), 0)
    reqs = p.next_requests(0)
    origin = {r.chunk for r in reqs if r.source == ORIGIN}
    # the seeders sorted are (me, s2): "me" owns the even slots 0, 2, 4; s2 already holds 0
    assert origin == {2, 4}
    assert Request(0, "s2") in reqs


def test_a_file_not_yet_at_the_origin_is_asked_again_soon_and_a_failing_origin_later():
    # a publish uploads while the rollout runs: a missing object is retried after a quarter second while
    # the rest of the stripe is read; an origin that errors is left alone for two seconds
    cfg = PolicyConfig(random_first=0, max_inflight=4, origin_inflight=1)
    p = pol(4, seeders=("me",), config=cfg)
    [r] = p.next_requests(0)
    assert r.source == ORIGIN
    p.chunk_failed(r.chunk, ORIGIN, "missing", 10.0)
    assert p.wake_at(10.0) == 10.25
    [other] = p.next_requests(10.0)
    assert other.source == ORIGIN and other.chunk != r.chunk          # not stuck behind the missing file
    p.chunk_failed(other.chunk, ORIGIN, "missing", 10.0)
    [third] = p.next_requests(10.0)
    assert third.chunk not in (r.chunk, other.chunk)
    p.chunk_done(third.chunk, ORIGIN, 1, 0.1, 10.1)
    assert {x.chunk for x in p.next_requests(10.1)} - {r.chunk, other.chunk}    # the fourth, never a missing one
    p = pol(4, seeders=("me",), config=cfg)
    [r] = p.next_requests(0)
    p.chunk_failed(r.chunk, ORIGIN, "error", 10.0)
    assert p.next_requests(10.0 + 2.0 - 0.01) == []
    assert [x.source for x in p.next_requests(10.0 + 2.0)] == [ORIGIN]


def test_a_chunk_missing_at_the_origin_is_asked_again_after_its_wait():
    cfg = PolicyConfig(random_first=0, max_inflight=4, origin_inflight=1)
    p = pol(2, seeders=("me",), config=cfg)
    [r] = p.next_requests(0)
    p.chunk_failed(r.chunk, ORIGIN, "missing", 10.0)
    [other] = p.next_requests(10.0)
    p.chunk_done(other.chunk, ORIGIN, 1, 0.1, 10.1)
    assert p.next_requests(10.2) == []                                 # only the missing one is left
    assert [(x.chunk, x.source) for x in p.next_requests(10.25)] == [(r.chunk, ORIGIN)]


def test_a_seeder_behind_on_its_stripe_reads_more_of_it_at_once():
    seeders = tuple(f"s{i}" for i in range(7)) + ("me",)
    p = pol(64, seeders=seeders, config=PolicyConfig(random_first=0, origin_inflight=1, origin_catch_up=3))
    mine = np.flatnonzero(p.origin_mask)
    others = np.flatnonzero(~p.origin_mask)
    assert len(mine) == 8
    # every stripe equally far along: one read at a time
    assert len([r for r in p.next_requests(0) if r.source == ORIGIN]) == 1
    # the other seeders are done with theirs (their chunks are held): this stripe is all that is left
    for i, s in enumerate(seeders[:-1]):
        p.peer_bitmap(s, bits(64, others), 0.1)
    origin = [r for r in p.next_requests(0.2) if r.source == ORIGIN]
    assert len(origin) == 2 and {r.chunk for r in origin} <= set(mine.tolist())
    assert p.origin_active == 3


def test_a_host_behind_its_peers_keeps_more_requests_in_flight_until_it_catches_up():
    cfg = PolicyConfig(random_first=0, max_inflight=4, max_per_peer=4, peer_catch_up=3)
    for held, budget in [(0, 7), (40, 7), (44, 4)]:     # peers hold 48: behind by more than 4 chunks, or not
        p = pol(64, have=bits(64, range(held)), config=cfg)
        for i in range(5):
            p.peer_bitmap(f"p{i}", bits(64, range(48)), 0)
        assert len(p.next_requests(0)) == budget and p.peer_requests == budget


def test_dead_seeder_stripe_moves_to_the_living():
    p = pol(6, seeders=("me", "s2"), config=PolicyConfig(random_first=0, max_inflight=6, origin_inflight=6))
    assert p.origin_mask.sum() == 3
    p.member_dead("s2")
    assert p.origin_mask.all()


def test_corrupt_peer_is_quarantined_and_never_asked_again():
    p = pol(4, config=PolicyConfig(random_first=0, max_inflight=4, max_per_peer=4))
    p.peer_bitmap("bad", np.ones(4, bool), 0)
    p.peer_bitmap("good", bits(4, [0]), 0)
    reqs = p.next_requests(0)
    bad = [r for r in reqs if r.source == "bad"]
    cancels = p.chunk_failed(bad[0].chunk, "bad", "corrupt", 1)
    assert {c.source for c in cancels} == {"bad"}          # its other requests are cancelled too
    assert p.peers["bad"].quarantined
    p.peer_bitmap("bad", np.ones(4, bool), 2)              # gossip cannot rehabilitate it
    assert all(r.source != "bad" for r in p.next_requests(3))


def test_missing_clears_a_stale_view():
    p = pol(2, config=PolicyConfig(random_first=0, max_inflight=1))
    p.peer_bitmap("a", bits(2, [1]), 0)
    [r] = p.next_requests(0)
    p.chunk_failed(r.chunk, "a", "missing", 0.1)
    assert p.avail[1] == 0 and p.next_requests(0.2) == []


def test_repeated_errors_declare_a_peer_dead_and_free_its_chunks():
    p = pol(3, config=PolicyConfig(random_first=0, max_inflight=3, max_errors=2, backoff_s=0.01))
    p.peer_bitmap("a", np.ones(3, bool), 0)
    p.peer_bitmap("b", np.ones(3, bool), 0)
    t = 0.0
    while p.peers["a"].alive:
        t += 1
        for r in p.next_requests(t):
            if r.source == "a":
                p.chunk_failed(r.chunk, "a", "error", t)
            else:
                p.chunk_failed(r.chunk, r.source, "cancelled", t)
    assert p.avail.tolist() == [1, 1, 1]
    assert all(r.source == "b" for r in p.next_requests(t + 1))


def test_slow_peer_is_evicted_then_retried():
    p = pol(100, config=PolicyConfig(random_first=0, max_inflight=40, max_per_peer=10, backoff_s=5, min_samples=3))
    for peer in "abcd":
        p.peer_bitmap(peer, np.ones(100, bool), 0)
    for _ in range(3):
        for r in p.next_requests(0):
            secs = 10.0 if r.source == "d" else 0.1
            p.chunk_done(r.chunk, r.source, 1000, secs, 0)
    p.tick(1)
    assert not p.peers["d"].usable(1) and p.peers["a"].usable(1)
    assert all(r.source != "d" for r in p.next_requests(2))
    assert p.peers["d"].usable(7)


def test_endgame_duplicates_and_cancels_the_loser():
    p = pol(2, config=PolicyConfig(random_first=0, max_inflight=2, max_per_peer=1, endgame_chunks=2))
    p.peer_bitmap("a", np.ones(2, bool), 0)
    p.peer_bitmap("b", np.ones(2, bool), 0)
    first = p.next_requests(0)
    assert len(first) == 2
    p.chunk_done(first[0].chunk, first[0].source, 10, 0.1, 0.1)
    dup = p.next_requests(0.2)
    assert dup == [Request(first[1].chunk, first[0].source)]
    cancels = p.chunk_done(first[1].chunk, first[0].source, 10, 0.1, 0.3)
    assert cancels == [Cancel(first[1].chunk, first[1].source)]
    assert p.complete


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["req", "done", "fail", "dead", "bitmap", "tick"]),
                          st.integers(0, 3), st.sampled_from(["busy", "missing", "error", "corrupt"]),
                          st.integers(0, 2**16)), max_size=60))
def test_invariants_under_random_events(events):
    n = 16
    cfg = PolicyConfig(random_first=1, max_inflight=4, max_per_peer=2, endgame_chunks=3)
    p = SwarmPolicy(me="me", n_chunks=n, config=cfg, seed=5, seeders=("me", "p0"))
    peers = [f"p{i}" for i in range(4)]
    live_reqs: list[Request] = []
    t = 0.0
    for kind, i, reason, mask in events:
        t += 0.1
        peer = peers[i]
        if kind == "bitmap":
            p.peer_bitmap(peer, np.array([(mask >> k) & 1 for k in range(n)], bool), t)
        elif kind == "req":
            for r in p.next_requests(t):
                assert not p.have[r.chunk]
                if r.source != ORIGIN:
                    ps = p.peers[r.source]
                    assert ps.alive and not ps.quarantined and ps.bits[r.chunk]
                else:
                    assert p.origin_mask[r.chunk]
                live_reqs.append(r)
        elif kind == "done" and live_reqs:
            r = live_reqs.pop(0)
            if r.source in p.inflight.get(r.chunk, ()):
                for c in p.chunk_done(r.chunk, r.source, 1, 0.1, t):
                    live_reqs.remove(Request(c.chunk, c.source))
        elif kind == "fail" and live_reqs:
            r = live_reqs.pop(0)
            if r.source in p.inflight.get(r.chunk, ()):
                for c in p.chunk_failed(r.chunk, r.source, reason, t):
                    live_reqs.remove(Request(c.chunk, c.source))
        elif kind == "dead":
            for c in p.peer_dead(peer):
                live_reqs.remove(Request(c.chunk, c.source))
        elif kind == "tick":
            p.tick(t)
        # bookkeeping always agrees with what is really outstanding
        assert p.peer_requests <= p.peer_budget + cfg.peer_catch_up
        assert p.origin_active <= max(cfg.origin_inflight, cfg.origin_catch_up)
        assert sorted((r.chunk, r.source) for r in live_reqs) == sorted(
            (c, s) for c, srcs in p.inflight.items() for s in srcs)
        for pid, ps in p.peers.items():
            assert ps.inflight == sum(1 for r in live_reqs if r.source == pid) <= cfg.max_per_peer
        usable = [ps.bits for ps in p.peers.values() if ps.alive and not ps.quarantined]
        assert p.avail.tolist() == (np.sum(usable, axis=0) if usable else np.zeros(n)).tolist()
        assert p.missing == n - int(p.have.sum())


def test_ranking_stays_inside_the_window_of_lowest_missing_chunks():
    p = pol(20, config=PolicyConfig(random_first=0, max_inflight=20, max_per_peer=20, window=5))
    p.peer_bitmap("a", np.ones(20, bool), 0)
    p.peer_bitmap("b", bits(20, range(10, 20)), 0)      # chunks 0-9 are rarer (one holder)
    reqs = p.next_requests(0)
    assert {r.chunk for r in reqs} == set(range(5))       # but only the lowest five are in the window
    for r in reqs:
        if r.chunk in (0, 1):
            p.chunk_done(r.chunk, r.source, 1, 0.1, 0.1)
    assert {r.chunk for r in p.next_requests(0.2)} == {5, 6}  # the window slides as the lowest arrive


def test_idle_peers_are_asked_for_their_rarest_chunk_when_the_plan_is_blocked():
    p = pol(6, config=PolicyConfig(random_first=0, max_inflight=4, max_per_peer=1))
    p.peer_bitmap("a", bits(6, [0, 1, 2]), 0)              # a holds the rarest chunks, one request at a time
    p.peer_bitmap("b", bits(6, [1, 2, 3, 4, 5]), 0)
    p.peer_bitmap("c", bits(6, [1, 2, 3, 4, 5]), 0)
    reqs = p.next_requests(0)
    assert len(reqs) == 3 and {r.source for r in reqs} == {"a", "b", "c"}   # every peer busy, none idle
    assert Request(0, "a") in reqs                                         # the rarest from its only holder


def test_peer_set_keeps_few_peers_from_other_racks():
    p = pol(4, rack="r1", config=PolicyConfig(max_cross_rack_peers=2))
    assert p.peer_bitmap("far1", np.ones(4, bool), 0, rack="r2")
    assert p.peer_bitmap("far2", np.ones(4, bool), 0, rack="r3")
    assert not p.peer_bitmap("far3", np.ones(4, bool), 0, rack="r2")   # a third remote peer is not tracked
    assert "far3" not in p.peers and p.avail.tolist() == [2, 2, 2, 2]
    assert p.peer_bitmap("near", np.ones(4, bool), 0, rack="r1")       # own-rack peers are not capped
    p.peer_dead("far1")
    assert p.peer_bitmap("far3", np.ones(4, bool), 1, rack="r2")       # a dead one's place is free again
    assert p.peer_bitmap("far1", np.ones(4, bool), 2, rack="r2")       # and a known peer may come back


def test_a_seeder_keeps_more_peer_requests_in_flight():
    """A lone seeder in its rack keeps ``seeder_inflight`` more peer requests going (its origin read
    shares its link); where most of the rack seeds, nobody does."""
    cfg = PolicyConfig(random_first=0, max_inflight=4, max_per_peer=1, seeder_inflight=2, peer_catch_up=0)
    rack = ("me", "s2", "h3", "h4", "h5")
    for seeders, budget in [(("me", "s2"), 6), (("s1", "s2"), 4), (("me", "s2", "h3"), 4)]:
        p = pol(30, seeders=seeders, rack_members=rack, config=cfg)
        for i in range(10):
            p.peer_bitmap(f"p{i}", np.ones(30, bool), 0)
        reqs = p.next_requests(0)
        assert p.peer_budget == budget and len(reqs) == budget and all(r.source != ORIGIN for r in reqs)
        p.chunk_done(reqs[0].chunk, reqs[0].source, 1, 0.1, 0.1)
        assert len(p.next_requests(0.1)) == 1 and p.peer_requests == budget
