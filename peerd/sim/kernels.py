"""The fleet driver's per-(host, chunk) and per-(host, peer) loops, compiled (numba).

At 10,000 hosts a time step ranks ~7,500 windows of 1,024 chunks and scores ~30,000 (host, peer)
pairs: as whole-matrix numpy that is ~150 ms a step, most of it temporaries. These loops do the
same work in one pass per row, skipping the cells a host already holds or has asked for.

They decide by ``peerd/choice.py``'s rules, compiled from the very functions ``SwarmPolicy`` calls
(``rarity``, ``tiebreak``, ``reach_ok``, ``source_score``), and draw their random numbers from the
simulator's generator in the order the numpy code did, so results are bit-identical to it.
Only the simulator imports this module: peerd itself never loads numba.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from peerd import choice

_rarity = njit(inline="always")(choice.rarity)
_tiebreak = njit(inline="always")(choice.tiebreak)
_reach_ok = njit(inline="always")(choice.reach_ok)
_source_score = njit(inline="always")(choice.source_score)
_NONE = np.iinfo(np.int64).max


@njit(inline="always")
def _usable(h, c, rank, n, nb_cnt, nb_far, backup, reach):
    """How many of host h's live neighbours it may ask for chunk c: its own rack's holders, and other
    racks' only where ``reach_ok`` lets it pull across (SwarmPolicy's ranking count). ``rank`` and
    ``n``: the host's place in its rack's stripe and the stripe's length."""
    cnt = np.int64(nb_cnt[h, c])
    far = nb_far[h, c]
    if far > 0 and not _reach_ok((rank - c) % n, n, backup[c], reach[c]):
        cnt -= far
    return cnt


@njit(cache=True)
def add_missing(rows, first, last, miss, miss_n) -> bool:
    """Chunks ``first .. last - 1`` were announced for the first time: every row now lacks them. Each
    host keeps the ids it lacks below the front (``miss[h, :miss_n[h]]``, unordered, with chunks it
    has since received until its next scan drops them), so a scan walks ~150 ids, not a window of
    1,024 mostly held. False (nothing added) if a row would overflow: compact or grow first."""
    for h in rows:
        if miss_n[h] + last - first > miss.shape[1]:
            return False
    for h in rows:
        n = miss_n[h]
        for c in range(first, last):
            miss[h, n] = c
            n += 1
        miss_n[h] = n
    return True


@njit(cache=True)
def drop_held(rows, miss, miss_n, have):
    """Drop the ids each row has received from its missing list."""
    for h in rows:
        n = 0
        for i in range(miss_n[h]):
            c = miss[h, i]
            if not have[h, c]:
                miss[h, n] = c
                n += 1
        miss_n[h] = n


@njit(cache=True)
def rank_plans(rows, lo, width, miss, miss_n, have, pend, nb_cnt, nb_far, rack_rank, rack_size, backup, reach,
               table, offset, plan, plan_ok):
    """``choice.rank_window`` over each row's window ``lo[i] .. lo[i] + width`` with the usable-holder
    count: the ``plan.shape[1]`` rarest wanted chunks, best first, into ``plan[rows[i]]``; ``plan_ok``
    marks the valid entries. Walks the row's missing list (dropping what it has received since): the
    window's other cells are held, and keys are unique within a window, so the plan is the one a scan
    of the whole window gives."""
    k = plan.shape[1]
    keys = np.empty(k, np.int64)
    ids = np.empty(k, np.int64)
    for i in range(len(rows)):
        h, start = rows[i], lo[i]
        rank, n, off = rack_rank[h], rack_size[h], offset[h]
        m = 0
        kept = 0
        for j in range(miss_n[h]):
            c = miss[h, j]
            if have[h, c]:
                continue
            miss[h, kept] = c
            kept += 1
            if c >= start + width or pend[h, c] or nb_cnt[h, c] == 0:
                continue
            cnt = _usable(h, c, rank, n, nb_cnt, nb_far, backup, reach)
            if cnt <= 0:
                continue
            key = _rarity(cnt, np.int64(_tiebreak(table, off, c)))
            if m < k:
                pos = m
                m += 1
            elif key >= keys[k - 1]:
                continue
            else:
                pos = k - 1
            while pos > 0 and keys[pos - 1] > key:     # insertion: the list stays sorted
                keys[pos], ids[pos] = keys[pos - 1], ids[pos - 1]
                pos -= 1
            keys[pos], ids[pos] = key, c
        miss_n[h] = kept
        for j in range(k):
            plan_ok[h, j] = j < m
            if j < m:
                plan[h, j] = ids[j]


@njit(cache=True)
def rarest_offered(rows, peers, far, lo, width, miss, miss_n, have, pend, known, nb_cnt, nb_far, rack_rank,
                   rack_size, backup, reach, table, offset, out):
    """SwarmPolicy._peer_first: for each row, the rarest chunk of its window that peer ``peers[i]`` is
    known to hold and the host wants (across racks only where it may pull), ranked by usable holders
    (at least one: the peer itself); -1 where there is none."""
    for i in range(len(rows)):
        h, s, start = rows[i], peers[i], lo[i]
        rank, n, off = rack_rank[h], rack_size[h], offset[h]
        best, best_c = _NONE, -1
        for j in range(miss_n[h]):
            c = miss[h, j]
            if c >= start + width or have[h, c] or pend[h, c] or not known[s, c]:
                continue
            if far[i] and not _reach_ok((rank - c) % n, n, backup[c], reach[c]):
                continue
            cnt = max(_usable(h, c, rank, n, nb_cnt, nb_far, backup, reach), 1)
            key = _rarity(cnt, np.int64(_tiebreak(table, off, c)))
            if key < best:
                best, best_c = key, c
        out[i] = best_c


@njit(cache=True)
def pick_sources(rows, chunks, nbr, known, same_rack, rack_rank, rack_size, backup, reach, believed_dead,
                 backoff, per_peer, load, now, max_per_peer, rng, k_out, found_out):
    """For each row, the neighbour it would ask now (SwarmPolicy._choose_source): among the live, not
    backed off, not full peers it has fewer than ``max_per_peer`` requests to that hold ``chunks[i]``
    (any peer where ``chunks`` is empty), the best ``source_score``; the load stands in for the
    throughput rank. One random draw per (row, neighbour), in row order, as the numpy code drew them."""
    width = nbr.shape[1]
    any_chunk = len(chunks) == 0
    u = rng.random(len(rows) * width, dtype=np.float32)
    for i in range(len(rows)):
        h = rows[i]
        cross = True
        if not any_chunk:
            c = chunks[i]
            n = rack_size[h]
            cross = _reach_ok((rack_rank[h] - c) % n, n, backup[c], reach[c])
        best, best_j = -np.inf, 0
        for j in range(width):
            # the cheap tests first: ``known`` is a row of another host, a cache miss at 10,000 hosts
            p, mine, near = nbr[h, j], per_peer[h, j], same_rack[h, j]
            if backoff[h, j] > now or mine >= max_per_peer or believed_dead[p] or load[p] >= 1.0:
                continue
            if not any_chunk and not ((near or cross) and known[p, chunks[i]]):
                continue
            ld = load[p]
            score = _source_score(near, mine, np.float64(u[i * width + j]), 0.74 * (1.0 - min(ld, 1.0)))
            if score > best:
                best, best_j = score, j
        k_out[i] = best_j
        found_out[i] = best > -np.inf


@njit(cache=True)
def count_announced(hosts, chunks, nbr, same_rack, believed_dead, n_hosts, nb_cnt, nb_far):
    """Bitmap pushes reach the neighbours: each (host, chunk) adds one known holder to every live
    neighbour's count (and to its other-rack count where the host is in another rack)."""
    for i in range(len(hosts)):
        h, c = hosts[i], chunks[i]
        if believed_dead[h]:
            continue
        for j in range(nbr.shape[1]):
            r = nbr[h, j]
            if r >= n_hosts:
                continue
            nb_cnt[r, c] += 1
            if not same_rack[h, j]:
                nb_far[r, c] += 1
