"""The batched decision rules (one row per deciding host) and the fluid link model."""
import numpy as np

from peerd.sim.fluid import max_min_rates
from peerd.choice import (origin_owner, origin_slots, rank_window, rarest_offered, rarity_key, source_scores,
                          tiebreak_params, tiebreak_rows)
from peerd.policy import SwarmPolicy


def rows(*xs):
    return np.array(xs[0] if len(xs) == 1 else xs)


def test_rarest_first_skips_held_asked_and_unavailable_chunks():
    cols = np.arange(6)[None, :]
    have = rows([1, 0, 0, 0, 0, 0]).astype(bool)[None, :]
    pend = rows([0, 1, 0, 0, 0, 0]).astype(bool)[None, :]
    holders = rows([1, 1, 3, 0, 2, 1])[None, :]
    table, off = tiebreak_params(np.random.default_rng(0), 1)
    cand, ok = rank_window(~have & ~pend, holders, cols[:, 0], table, off, 4)
    got = cand[0][ok[0]].tolist()
    assert got[0] == 5 and got[1:] == [4, 2]        # 1 holder, then 2, then 3; 0, 1, 3 excluded
    one, ok1 = rank_window(~have & ~pend, holders, cols[:, 0], table, off, 1)
    assert ok1[0, 0] and one[0, 0] == got[0]         # the k=1 shortcut agrees


def test_equally_rare_chunks_are_picked_at_random_and_differently_per_host():
    n = 64
    cols = np.tile(np.arange(n), (200, 1))
    table, off = tiebreak_params(np.random.default_rng(1), 200)
    cand, ok = rank_window(np.ones((200, n), bool), np.ones((200, n), int), cols[:, 0], table, off, 1)
    assert ok.all() and len(set(cand[:, 0].tolist())) > 40   # 200 hosts do not herd on one chunk
    again, _ = rank_window(np.ones((200, n), bool), np.ones((200, n), int), cols[:, 0], table, off, 1)
    assert (again == cand).all()                              # and the order is reproducible


def test_no_wanted_chunk_is_reported_invalid():
    cols = np.arange(3)[None, :]
    table, off = tiebreak_params(np.random.default_rng(0), 1)
    _, ok = rank_window(np.zeros((1, 3), bool), np.ones((1, 3), int), cols[:, 0], table, off, 2)
    assert not ok.any()
    full, okf = rank_window(np.ones((1, 3), bool), np.array([[2, 1, 3]]), cols[:, 0], table, off, 3)
    assert okf.all() and full[0].tolist() == [1, 0, 2]       # k = window: all of it, rarest first


def test_the_rarest_offered_chunk_is_rank_window_of_one_over_a_known_key():
    rng = np.random.default_rng(4)
    table, off = tiebreak_params(rng, 1)
    found = 0
    for _ in range(500):
        w, lo = int(rng.integers(1, 40)), int(rng.integers(0, 1000))
        holders = rng.integers(1, 5, (1, w))
        offered = rng.random(w) < rng.random()
        cand, ok = rank_window(offered[None, :], holders, np.array([lo]), table, off, 1)
        i = rarest_offered(rarity_key(holders, np.array([lo]), table, off)[0], offered)
        assert (i >= 0) == bool(ok[0, 0]) and (i < 0 or lo + i == cand[0, 0])
        found += i >= 0
    assert 100 < found < 500                          # both outcomes were checked
    assert rarest_offered(np.array([5, 1, 3]), np.array([True, False, True])) == 2   # the lowest key offered


def test_source_prefers_own_rack_then_fewer_requests_then_speed():
    rng = np.random.default_rng(0)
    holds = rows([True, True, True, False])[None, :]
    same = rows([False, True, True, True])[None, :]
    mine = rows([0, 2, 0, 0])[None, :]
    assert np.argmax(source_scores(holds, same, mine, rng)) == 2          # same rack, idle
    holds2 = rows([True, True, False, False])[None, :]
    assert np.argmax(source_scores(holds2, same, mine, rng)) == 1         # same rack beats idle remote
    s = source_scores(rows([True, True])[None, :], rows([True, True])[None, :], rows([0, 0])[None, :], rng,
                      rows([0.0, 0.9])[None, :])
    assert np.argmax(s) == 1                                                # then the faster
    assert np.isinf(source_scores(holds, same, mine, rng)[0, 3])           # a non-holder never
    busy_local = source_scores(rows([True, True])[None, :], rows([True, False])[None, :],
                               rows([1000, 0])[None, :], rng)
    assert np.argmax(busy_local) == 0                                       # rack first, even with a huge cap


def test_max_min_rates_share_links_fairly_and_fill_them():
    # one uploader, two downloaders: half each
    r = max_min_rates(np.array([0, 0]), np.array([0, 1]), np.ones(1), np.ones(2))
    assert np.allclose(r, [0.5, 0.5])
    # uploader 0 serves downloaders 0 and 1; uploader 1 serves downloader 1 only:
    # downloader 1 is shared, so flows 0->1 and 1->1 get 1/2 and 0->0 takes the rest of uploader 0
    r = max_min_rates(np.array([0, 0, 1]), np.array([0, 1, 1]), np.ones(2), np.ones(2))
    assert np.allclose(r, [0.5, 0.5, 0.5])
    # a busy uploader (3 flows) and a free one: the downloader fed by both fills up from the free one
    r = max_min_rates(np.array([0, 0, 0, 1]), np.array([0, 1, 2, 2]), np.ones(2), np.ones(3))
    assert np.allclose(r[:3], 1 / 3) and np.isclose(r[3], 2 / 3)
    # never over a capacity
    rng = np.random.default_rng(3)
    src, dst = rng.integers(0, 50, 2000), rng.integers(0, 50, 2000)
    r = max_min_rates(src, dst, np.ones(50), np.ones(50))
    assert (np.bincount(src, r, 50) <= 1 + 1e-9).all() and (np.bincount(dst, r, 50) <= 1 + 1e-9).all()
    assert np.bincount(dst, r, 50).mean() > 0.9                            # and nearly full


def test_cross_rack_importers_widen_by_doubling_after_the_rescue():
    from peerd.choice import cross_rack_ok
    dist = np.arange(500)                       # every member of a 500-host rack, by distance from the importer
    allowed = [int(cross_rack_ok(dist, 500, np.full(500, age), 2.0, 10.0).sum()) for age in (0, 2, 9.9, 10, 12, 14, 26)]
    assert allowed == [1, 2, 2, 3, 5, 9, 500]  # importer; + backup; + 2, 4, 8 ... first members; all 8 grace later


def test_origin_stripes_balance_bytes_not_chunk_counts():
    """The 16-host bench's layout: 256 MiB in 3 files of 1 MiB chunks is 258 chunks (a short one ends
    each file). By chunk index two of 16 seeders read 17 MiB (the origin's copy takes 17/16 of S/B);
    by origin slot nobody reads more than 16 MiB and a short chunk."""
    mib = 1 << 20
    sizes = np.array(([mib] * 85 + [mib // 3]) * 3)
    by_index = np.bincount(np.arange(len(sizes)) % 16, weights=sizes)
    by_slot = np.bincount(origin_owner(origin_slots(sizes), np.ones(16, bool)), weights=sizes)
    assert by_index.max() == 17 * mib
    assert by_slot.max() <= 16 * mib + mib // 3 and by_slot.sum() == sizes.sum()
    assert (origin_slots(np.full(10, 4096)) == np.arange(10)).all()       # equal chunks: slot = index
    seeders = tuple(f"s{i:02d}" for i in range(16))
    mine = [SwarmPolicy(me=s, n_chunks=len(sizes), seeders=seeders, origin_slots=origin_slots(sizes)).origin_mask
            for s in seeders]
    assert (np.sum(mine, axis=0) == 1).all()                              # every chunk has one reader
    assert max(sizes[mask].sum() for mask in mine) == by_slot.max()       # the daemon's policy stripes by slot


def test_each_row_reads_the_shared_order_at_its_offset():
    rng = np.random.default_rng(3)
    lo = rng.integers(0, 200, 40)
    table, off = tiebreak_params(rng, 40)
    tie = np.stack([table[(np.arange(s, s + 64) + o) % len(table)] for s, o in zip(lo, off)])
    assert (tiebreak_rows(table, off, lo, 64) == tie).all()
    empty, ok = rank_window(np.ones((2, 0), bool), np.ones((2, 0), int), np.array([5, 6]), table, off[:2], 3)
    assert empty.shape == (2, 0) and ok.shape == (2, 0)                 # an empty window ranks nothing
