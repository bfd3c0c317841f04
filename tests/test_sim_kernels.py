"""The simulator's compiled loops (``peerd/sim/kernels.py``) decide as ``peerd/choice.py``'s numpy
rules do, cell by cell, on a fleet mid-run: racks, deaths, loads, back-offs, and chunks old enough
for the backup importer and the rescue widening."""
import os
import subprocess
import sys
import time

import numpy as np

from peerd.choice import rank_window, source_scores
from peerd.sim import kernels
from peerd.sim.config import SimConfig
from peerd.sim.fleet import FleetSim

CHUNK = 64 * 2**20
W = 40                      # a window narrow enough that the plans are full and the edge matters


def states():
    """A 120-host, 4-rack fleet with a slow origin (chunks age in the windows) and 16 seeders, every 50 steps."""
    sim = FleetSim(SimConfig(hosts=120, size=300 * CHUNK, racks=4, fail_fraction=0.1, seed=5,
                             origin_rate=10e9 / 8 / 4, seeders=16))
    while sim.remaining and sim.step < 1500:
        now = sim.advance()
        if sim.step % 50 == 0:
            yield sim, now, np.flatnonzero(sim.alive[:sim.N] & np.isnan(sim.done_at))


def per_cell_usable(sim, hosts, cols, now):
    """SwarmPolicy's ranking count, cell by cell: rack-local holders, others' only where
    ``choice.cross_rack_ok`` allows."""
    ok = sim._cross_ok(hosts, cols, now)
    return sim.nb_cnt[hosts[:, None], cols] - np.where(ok, 0, sim.nb_far[hosts[:, None], cols]), ok


def test_plans_are_rank_window_over_the_per_cell_rule():
    remote = backup = rescue = ranked = 0
    pol = None
    for sim, now, hosts in states():
        pol = sim.cfg.policy
        lo = sim.lo[hosts]
        cols = lo[:, None] + np.arange(W)
        usable, _ = per_cell_usable(sim, hosts, cols, now)
        want = ~sim.have[hosts[:, None], cols] & ~sim.pend[hosts[:, None], cols]
        cand, ok = rank_window(want, usable, lo, sim.tb_a, sim.tb_b[hosts], sim.K)
        plan, plan_ok = np.zeros_like(sim.plan), np.zeros_like(sim.plan_ok)
        kernels.rank_plans(hosts, lo, W, sim.offered, sim.offered_n, sim.have, sim.pend, sim.nb_cnt, sim.nb_far,
                           sim.rack_rank, sim.rack_size, *sim._reach(now), sim.tb_a, sim.tb_b, plan, plan_ok)
        assert (plan_ok[hosts] == ok).all()
        assert (plan[hosts][ok] == cand[ok]).all()
        ranked += int(ok.sum())
        far = sim.nb_far[hosts[:, None], cols] > 0
        age = now - sim.seen[cols]
        remote += int(far.sum())
        backup += int((far & (age >= pol.rack_grace_s)).sum())
        rescue += int((far & (age >= pol.rack_rescue_s)).sum())
    assert ranked > 1000 and remote > 1000 and backup > 100 and rescue > 100, (ranked, remote, backup, rescue)


def test_the_rarest_chunk_a_peer_offers_is_rank_window_over_its_holdings():
    found = 0
    for sim, now, alive in states():
        for j in range(0, sim.nbr.shape[1], 4):
            peers = sim.nbr[alive, j]
            hosts, peers = alive[peers < sim.N], peers[peers < sim.N]
            far = sim.rack[peers] != sim.rack[hosts]
            lo = sim.lo[hosts]
            cols = lo[:, None] + np.arange(W)
            usable, cross = per_cell_usable(sim, hosts, cols, now)
            want = (~sim.have[hosts[:, None], cols] & ~sim.pend[hosts[:, None], cols]
                    & sim.knows(peers[:, None], cols) & (cross | ~far[:, None]))
            cand, ok = rank_window(want, np.maximum(usable, 1), lo, sim.tb_a, sim.tb_b[hosts], 1)
            out = np.empty(len(hosts), np.int64)
            kernels.rarest_offered(hosts, peers, far, lo, W, sim.offered, sim.offered_n, sim.have, sim.pend, sim.shown,
                                   sim.nb_cnt, sim.nb_far, sim.rack_rank, sim.rack_size, *sim._reach(now),
                                   sim.tb_a, sim.tb_b, out)
            assert (out == np.where(ok[:, 0], cand[:, 0], -1)).all()
            found += int(ok.sum())
    assert found > 500, found


class KernelDraws:
    """A stand-in generator that hands ``source_scores`` the kernels' draws (``kernels.uniform``)."""

    def __init__(self, u):
        self.u = u

    def random(self, shape, dtype):
        assert shape == self.u.shape
        return self.u.astype(dtype)             # 24-bit draws: exact in float32


def best_by_source_scores(sim, hosts, ready, key):
    """SwarmPolicy's pick among ``ready`` neighbours, through ``choice.source_scores`` (-1: none)."""
    peers = sim.nbr[hosts]
    score = source_scores(ready, sim.same_rack[hosts], sim.per_peer[hosts],
                          KernelDraws(kernels.draws(key, hosts, sim.nbr.shape[1])),
                          0.74 * (1.0 - np.minimum(sim.load[peers], 1.0)))
    return np.where(ready.any(axis=1), np.argmax(score, axis=1), -1)


def fresh_lists(sim):
    """Ready lists not yet looked at this step (``kernels._ready_peers``), and the neighbour each host
    asked since (the fleet's own: ``sim._ask`` sets it)."""
    return np.zeros_like(sim.nbr), np.full(sim.N, -1), sim.asked


def walk(sim, hosts, key, plan_ptr, now, lists):
    return kernels.next_entries(hosts, key, sim.n_down, sim.budget, sim.plan, sim.plan_ok, plan_ptr, sim.have,
                                sim.pend, sim.nbr, sim.known, sim.nbr_slot, sim.same_rack, sim.rack_rank, sim.rack_size,
                                *sim._reach(now), sim.believed_dead, sim.backoff, sim.per_peer, sim.load, now,
                                sim.cfg.policy.max_per_peer, *lists)


def ready_peers(sim, hosts, now):
    """SwarmPolicy's ready peers, per cell: believed alive, not backed off, not full, under the cap."""
    peers = sim.nbr[hosts]
    return (~sim.believed_dead[peers] & (sim.backoff[hosts] <= now) & (sim.load[peers] < 1.0)
            & (sim.per_peer[hosts] < sim.cfg.policy.max_per_peer))


def test_what_peers_know_is_what_was_pushed():
    """The bits of ``known`` (rack by rack, each rack on its own cache lines) say exactly what each host
    held at its last bitmap push; every host has a bit of its own. 150 hosts a rack: three words."""
    sim = FleetSim(SimConfig(hosts=300, size=120 * CHUNK, racks=2, fail_fraction=0.1, seed=3, seeders=16))
    hosts, pushes = np.arange(sim.N), 0
    while sim.step * sim.dt < 0.6 * sim.lower:         # past the first deaths, before anyone finishes
        sim.advance()
        if sim.announced:
            assert (sim.knows(hosts[:, None], np.arange(sim.C)) == sim.have[:sim.N, :sim.C]).all()
            pushes += 1
    held = sim.have[:sim.N, :sim.C].sum()
    assert pushes > 30 and 0.1 < held / sim.have[:sim.N, :sim.C].size < 0.9 and not sim.alive[:sim.N].all()
    assert len(np.unique(sim.slot)) == sim.N + 1
    for r in range(sim.cfg.racks):
        lines = np.unique(sim.slot[:sim.N][sim.rack[:sim.N] == r] // 512)
        assert np.isin(lines, sim.slot[:sim.N][sim.rack[:sim.N] != r] // 512).sum() == 0


def offered_lists_hold(sim):
    """Each live unfinished host's offered list is ascending, without repeats, and holds every chunk
    some neighbour it believes alive is known to hold that it lacks (and, until a ranking drops
    them, chunks it has received since)."""
    checked = 0
    for h in np.flatnonzero(sim.alive[:sim.N] & np.isnan(sim.done_at)):
        got = sim.offered[h, :sim.offered_n[h]]
        want = np.flatnonzero((sim.nb_cnt[h, :sim.C] > 0) & ~sim.have[h, :sim.C])
        assert (np.diff(got) > 0).all()
        assert np.array_equal(got[~sim.have[h, got]], want)
        checked += len(want)
    return checked


def test_the_offered_lists_follow_the_pushes_deaths_and_overflows():
    """``count_announced`` keeps each host's list of what its neighbours offer in step with their
    bitmap pushes; a neighbour declared dead takes its chunks off (``list_offered``); a list that
    fills up is rebuilt with room for twice as many. A fleet whose lists start at 4 slots ends
    exactly as one whose lists never fill. Six neighbours a host and many deaths: a dead neighbour
    is often the only one known to hold a chunk."""
    cfg = SimConfig(hosts=120, size=300 * CHUNK, racks=4, fail_fraction=0.3, seed=5, origin_rate=10e9 / 8 / 4,
                    max_active_peers=6, seeders=16)
    roomy, tight = FleetSim(cfg), FleetSim(cfg)
    tight.offered = np.zeros((tight.N, 4), tight.offered.dtype)
    checked = detected = 0
    while roomy.remaining and roomy.step < 1500:
        roomy.advance()
        tight.advance()
        if roomy.step % 10 == 0:
            checked += offered_lists_hold(roomy) + offered_lists_hold(tight)
            detected = int(roomy.believed_dead.sum())
    assert checked > 10000 and detected > 20 and tight.offered.shape[1] > 4, (checked, detected)
    assert (roomy.have == tight.have).all() and (roomy.plan == tight.plan).all()


def test_the_draws_are_uniform_and_independent():
    """The kernels' random draws (a hash of round, host and neighbour): uniform, and unrelated across
    rounds, hosts and neighbours."""
    rows = np.arange(4000)
    a = kernels.draws(kernels.round_key(1, 7, 0), rows, 32)
    b = kernels.draws(kernels.round_key(1, 7, 1), rows, 32)
    c = kernels.draws(kernels.round_key(1, 8, 0), rows, 32)
    d = kernels.draws(kernels.round_key(2, 7, 0), rows, 32)
    assert a.min() >= 0 and a.max() < 1
    counts = np.bincount((a * 20).astype(int).ravel(), minlength=20)
    expect = a.size / 20
    assert ((counts - expect) ** 2 / expect).sum() < 60        # chi-square, 19 d.o.f.: p ~ 1e-6
    for x, y in [(a, b), (a, c), (a, d), (a[:, :-1], a[:, 1:]), (a[:-1], a[1:])]:
        assert abs(np.corrcoef(x.ravel(), y.ravel())[0, 1]) < 0.01
    assert (kernels.draws(kernels.round_key(1, 7, 0), rows, 32) == a).all()   # a key replays its draws


def test_peer_first_sources_are_picked_by_source_scores_with_the_same_draws():
    picked = 0
    for sim, now, hosts in states():
        ready = ready_peers(sim, hosts, now)
        key = kernels.round_key(5, sim.step, 3)
        k = np.empty(len(hosts), np.int64)
        kernels.pick_sources(hosts, key, sim.nbr, sim.known, sim.nbr_slot, sim.same_rack, sim.believed_dead, sim.backoff,
                             sim.per_peer, sim.load, now, sim.cfg.policy.max_per_peer, *fresh_lists(sim), k)
        assert (k == best_by_source_scores(sim, hosts, ready, key)).all()
        picked += int((k >= 0).sum())
    assert picked > 500, picked


def test_the_parallel_loops_use_only_idle_cores():
    """A parallel loop waits for all its threads, so on a busy machine the simulator runs on one."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.5)                      # the spinners are running
        assert kernels.use_idle_cores() == 1
    finally:
        for p in spin:
            p.kill()
            p.wait()


def test_a_round_walks_the_plan_to_the_first_entry_a_ready_neighbour_holds():
    """SwarmPolicy.next_requests looks only at plan entries some ready peer holds, and asks the one
    ``source_scores`` ranks best; the fleet driver's round walks each host's plan the same way (past
    held, asked-for and unreachable entries)."""
    walked = skipped = rounds = 0
    for sim, now, hosts in states():
        sim._rank(hosts, sim.W, now)                   # fresh plans, as after a bitmap push
        key = kernels.round_key(5, sim.step, 0)
        ptr0 = sim.plan_ptr.copy()
        expect = {}
        for h in hosts:
            if sim.n_down[h] >= sim.budget[h] or ptr0[h] >= sim.K or not sim.plan_ok[h, ptr0[h]]:
                continue
            p, got, src = ptr0[h], -1, -1
            while p < sim.K and sim.plan_ok[h, p] and got < 0:
                c = sim.plan[h, p]
                p += 1
                if sim.have[h, c] or sim.pend[h, c]:
                    continue
                ready = (ready_peers(sim, np.array([h]), now)[0] & sim.knows(sim.nbr[h], c)
                         & (sim.same_rack[h] | sim._cross_ok(np.array([h]), np.array([c]), now)))
                if ready.any():
                    got, src = c, int(best_by_source_scores(sim, np.array([h]), ready[None], key)[0])
                else:
                    skipped += 1
            expect[h] = (got, p, src)
        plan_ptr, lists = ptr0.copy(), fresh_lists(sim)
        h, c, k, tried = walk(sim, hosts, key, plan_ptr, now, lists)
        assert tried == len(expect)
        assert {g: (e, j) for g, e, j in zip(h.tolist(), c.tolist(), k.tolist())} == {
            g: (e[0], e[2]) for g, e in expect.items() if e[0] >= 0}
        assert all(plan_ptr[g] == e[1] for g, e in expect.items())
        # the next round, after these requests, on the lists kept from this one: as if looked at afresh
        sim._ask(h, c, k, now)
        key = kernels.round_key(5, sim.step, 1)
        kept = walk(sim, hosts, key, plan_ptr.copy(), now, lists)
        again = walk(sim, hosts, key, plan_ptr.copy(), now, fresh_lists(sim))
        assert all((a == b).all() for a, b in zip(kept[:3], again[:3])) and kept[3] == again[3]
        rounds += len(kept[0])
        walked += len(expect)
    assert walked > 1000 and skipped > 100 and rounds > 200, (walked, skipped, rounds)


def test_the_daemon_never_loads_numba():
    """numba is the simulator's; a peerd process imports the same rules without it."""
    code = ("import sys, peerd.__main__, peerd.daemon, peerd.policy, peerd.job, peerd.server, peerd.choice; "
            "sys.exit('numba' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_uploader_takes_a_uniform_random_subset_of_its_requests():
    """``kernels.ask``: an uploader with F free upload slots and R > F requests takes exactly F of
    them, each request with chance F/R; the rest hear busy, a dead uploader's requesters back off."""
    max_uploads, backoff_s, busy_s, now = 8, 1.0, 0.25, 10.0
    nbr = np.tile([12, 13, 14], (12, 1))                 # hosts 0-11; 12 and 13 upload; 14 is dead
    h, k, c = np.arange(12), np.array([0] * 10 + [1, 2]), np.arange(12) % 5
    alive = np.ones(17, bool)
    alive[14] = False
    rng = np.random.default_rng(0)
    taken = np.zeros(12)
    for _ in range(2000):
        n_up = np.zeros(17, np.int64)
        n_up[12] = max_uploads - 3                         # three free slots for ten requests
        backoff, per_peer = np.zeros((12, 3)), np.zeros((12, 3), np.int64)
        src = np.full((12, 9), -1, np.int64)
        chunk, left, nk = np.zeros((12, 9), np.int64), np.zeros((12, 9)), np.zeros((12, 9), np.int64)
        carry, pend, n_down = np.full(12, 0.25), np.zeros((12, 5), bool), np.zeros(12, np.int64)
        kernels.ask(h, c, k, now, nbr, alive, max_uploads, backoff_s, busy_s, rng.random(len(h)), n_up, backoff, src,
                    chunk, left, nk, carry, pend, n_down, per_peer, np.full(12, -1))
        got = src[:, 0] >= 0
        assert got[:10].sum() == 3 and n_up[12] == max_uploads and got[10] and not got[11] and n_up[13] == 1
        assert (backoff[:10, 0] == np.where(got[:10], 0, now + busy_s)).all() and backoff[11, 2] == now + backoff_s
        assert (pend[h[got], c[got]]).all() and pend.sum() == 4 and (n_down == got).all()
        assert (left[got, 0] == 0.75).all() and (carry[got] == 0).all() and (per_peer[got, k[got]] == 1).all()
        taken += got
    assert np.abs(taken[:10] / 2000 - 0.3).max() < 0.05, taken
