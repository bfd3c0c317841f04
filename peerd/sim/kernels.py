"""The fleet driver's per-(host, chunk) and per-(host, peer) loops, compiled (numba).

At 10,000 hosts a time step ranks ~7,500 windows of up to 1,024 chunks and scores ~35,000 (host, 32
neighbours) rows: as whole-matrix numpy that was ~145 ms a step, most of it temporaries. These loops do the
same work in one pass per row, skipping the cells a host already holds or has asked for.

They decide by ``peerd/choice.py``'s rules, compiled from the very functions ``SwarmPolicy`` calls
(``rarity``, ``tiebreak``, ``reach_ok``, ``source_score``). Compiled, the driver first gave
bit-identical results to the numpy one (four configurations compared byte for byte); since session
12 the scoring draws are a hash (``uniform``), made only for the neighbours scored, the same for any
thread count. Only the simulator imports this module: peerd never loads numba.
"""
from __future__ import annotations

import os
import time

import numba
import numpy as np
from numba import njit, prange

from peerd import choice
from peerd.sim.fluid import rates_with_priority

_rarity = njit(inline="always")(choice.rarity)
_tiebreak = njit(inline="always")(choice.tiebreak)
_reach_ok = njit(inline="always")(choice.reach_ok)
_source_score = njit(inline="always")(choice.source_score)
_NONE = np.iinfo(np.int64).max


def use_idle_cores(sample_s: float = 0.2) -> int:
    """Run the parallel loops on the cores idle now (sampled from /proc/stat), and return how many.
    Each loop waits for all its threads, so one descheduled thread stalls the step: beside another
    simulation on this 2-core machine, two threads each made both runs 3x slower than one thread
    each (19.8 s against 6.7 s for ``weightcast sim --hosts 1000 --size 100GB``).
    ``NUMBA_NUM_THREADS`` in the environment wins."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return numba.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        a = _cpu_times()
        time.sleep(sample_s)
        b = _cpu_times()
        idle = cores * (b[1] - a[1]) / max(b[0] - a[0], 1)
    except OSError:                                    # no /proc: the load average is the next best
        idle = cores - os.getloadavg()[0]
    numba.set_num_threads(max(1, min(numba.config.NUMBA_NUM_THREADS, int(idle + 0.5))))
    return numba.get_num_threads()


def _cpu_times() -> tuple[int, int]:
    """(all, idle) jiffies of the machine so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


@njit(inline="always")
def _knows(known, slot, p, c):
    """Is host p known (by its bitmap pushes) to hold chunk c? ``known``: one bit per (chunk, host
    slot); ``slot``: each host's bit (``bit_slots``)."""
    b = slot[p]
    return ((known[c, b >> 6] >> np.uint64(b & 63)) & np.uint64(1)) != 0


def bit_slots(rack: np.ndarray, racks: int) -> tuple[np.ndarray, int]:
    """Each host's bit in a chunk's row of ``known`` (one more at the end for the padding id,
    "nobody"), and the row's length in 64-bit words. Hosts go rack by rack, each rack starting on a
    fresh cache line: a round reads one chunk's bits for a host's ~20 rack-mates, and that is one
    line instead of ~20 (profiled: the rounds' main cost)."""
    sizes = np.bincount(rack, minlength=racks)
    start = np.concatenate([[0], np.cumsum(-(-sizes // 512) * 512)])     # 512 bits: one cache line
    slot = np.empty(len(rack) + 1, np.int64)
    fill = start[:-1].copy()
    for h, r in enumerate(rack):
        slot[h] = fill[r]
        fill[r] += 1
    slot[-1] = start[-1]
    return slot, int(start[-1]) // 64 + 1


@njit(inline="always")
def _shows(shown, p, c):
    """``_knows`` from the host-major copy: ``shown[p]`` is host p's pushed bitmap, one bit per chunk.
    A scan of one peer's holdings over a window reads a few words of its row, where ``known`` costs a
    cache line per chunk."""
    return ((shown[p, c >> 6] >> np.uint64(c & 63)) & np.uint64(1)) != 0


@njit(cache=True)
def set_known(known, slot, shown, seen, hosts, chunks, now):
    """Hosts' bitmap pushes arrived at ``now``: ``hosts[i]`` is known to hold ``chunks[i]`` (in both
    layouts), and ``seen`` keeps each chunk's first announcement. Returns 1 + the highest chunk id
    announced."""
    top = 0
    for i in range(len(hosts)):
        b, c = slot[hosts[i]], chunks[i]
        known[c, b >> 6] |= np.uint64(1) << np.uint64(b & 63)
        shown[hosts[i], c >> 6] |= np.uint64(1) << np.uint64(c & 63)
        seen[c] = min(seen[c], now)
        top = max(top, c + 1)
    return top


@njit(cache=True)
def knows(known, slot, hosts, chunks):
    """``_knows`` for each (hosts[i], chunks[i]), as booleans."""
    out = np.empty(len(hosts), np.bool_)
    for i in range(len(hosts)):
        out[i] = _knows(known, slot, hosts[i], chunks[i])
    return out


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


@njit(inline="always")
def _mod_next(c, prev, prev_mod, n):
    """``c % n`` given ``prev % n`` for an earlier id ``prev`` (-1: none): a step up the ascending
    offered list adds, where a division per cell was a fifth of the ranking's time."""
    d = c - prev
    if prev < 0 or d < 0 or d >= n:
        return c % n
    m = prev_mod + d
    return m - n if m >= n else m


@njit(cache=True)
def list_offered(rows, nb_cnt, have, n_chunks, offered, offered_n) -> bool:
    """Rebuild these rows' offered lists from the counts (``count_announced`` keeps them up to date;
    this is for a row that overflowed, or whose counts fell to zero when a neighbour was declared
    dead). False (rows left as they were) where a list would not fit: grow ``offered`` first."""
    for h in rows:
        n = 0
        for c in range(n_chunks):
            n += nb_cnt[h, c] > 0 and not have[h, c]
        if n > offered.shape[1]:
            return False
    for h in rows:
        n = 0
        for c in range(n_chunks):
            if nb_cnt[h, c] > 0 and not have[h, c]:
                offered[h, n] = c
                n += 1
        offered_n[h] = n
    return True


@njit(cache=True, parallel=True)
def rank_plans(rows, lo, width, offered, offered_n, have, pend, nb_cnt, nb_far, rack_rank, rack_size, backup, reach,
               table, offset, plan, plan_ok):
    """``choice.rank_window`` over each row's window ``lo[i] .. lo[i] + width`` with the usable-holder
    count: the ``plan.shape[1]`` rarest wanted chunks, best first, into ``plan[rows[i]]``; ``plan_ok``
    marks the valid entries. Walks the row's offered list (dropping what it has received since): the
    window's other cells are held or have no holder, and keys are unique within a window (the list's
    order does not matter), so the plan is the one a scan of the whole window gives. Two passes: the
    first counts usable holders and finds the fewest-holders class that fills the plan, the second
    sorts in only the candidates up to that class (inserting every candidate into the sorted plan was
    a quarter of the time)."""
    k = plan.shape[1]
    for i in prange(len(rows)):
        h, start = rows[i], lo[i]
        rank, n, off = rack_rank[h], rack_size[h], offset[h]
        cand = np.empty(offered_n[h], np.int64)
        cnts = np.empty(offered_n[h], np.int64)
        per_cnt = np.zeros(256, np.int64)          # candidates by usable holders (nb_cnt is a uint8)
        nc = 0
        kept = 0
        prev, prev_mod = -1, 0
        for j in range(offered_n[h]):
            c = offered[h, j]
            if have[h, c]:
                continue
            offered[h, kept] = c
            kept += 1
            if c >= start + width or pend[h, c] or nb_cnt[h, c] == 0:
                continue
            cnt = np.int64(nb_cnt[h, c])
            far = nb_far[h, c]
            if far > 0:
                prev_mod = _mod_next(c, prev, prev_mod, n)
                prev = c
                dist = rank - prev_mod                 # (rank - c) % n for a rank in 0 .. n - 1
                if dist < 0:
                    dist += n
                if not 0 <= rank < n:
                    dist = (rank - c) % n
                if not _reach_ok(dist, n, backup[c], reach[c]):
                    cnt -= far
            if cnt <= 0:
                continue
            cand[nc], cnts[nc] = c, cnt
            nc += 1
            per_cnt[cnt] += 1
        offered_n[h] = kept
        limit, total = 0, 0                        # the fewest holders that fills the plan (or all)
        while limit < 255 and total + per_cnt[limit] < k:
            total += per_cnt[limit]
            limit += 1
        keys = np.empty(k, np.int64)
        ids = np.empty(k, np.int64)
        m = 0
        for j in range(nc):
            if cnts[j] > limit:
                continue
            c = cand[j]
            key = _rarity(cnts[j], np.int64(_tiebreak(table, off, c)))
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
        for j in range(k):
            plan_ok[h, j] = j < m
            if j < m:
                plan[h, j] = ids[j]


@njit(cache=True, parallel=True)
def rarest_offered(rows, peers, far, lo, width, offered, offered_n, have, pend, shown, nb_cnt, nb_far, rack_rank,
                   rack_size, backup, reach, table, offset, out):
    """SwarmPolicy._peer_first: for each row, the rarest chunk of its window that peer ``peers[i]`` is
    known to hold and the host wants (across racks only where it may pull), ranked by usable holders
    (at least one: the peer itself); -1 where there is none."""
    for i in prange(len(rows)):
        h, s, start = rows[i], peers[i], lo[i]
        rank, n, off = rack_rank[h], rack_size[h], offset[h]
        best, best_c = _NONE, -1
        for j in range(offered_n[h]):              # (a chunk s is known to hold is on the list)
            c = offered[h, j]
            if c >= start + width or have[h, c] or pend[h, c] or not _shows(shown, s, c):
                continue
            if far[i] and not _reach_ok((rank - c) % n, n, backup[c], reach[c]):
                continue
            cnt = max(_usable(h, c, rank, n, nb_cnt, nb_far, backup, reach), 1)
            key = _rarity(cnt, np.int64(_tiebreak(table, off, c)))
            if key < best:
                best, best_c = key, c
        out[i] = best_c


@njit(inline="always")
def _open(h, j, p, now, backoff, per_peer, max_per_peer, believed_dead, load):
    """Would host h ask its neighbour j (host p) now: alive as far as h knows, not backed off, not
    full when it last reported, and fewer than ``max_per_peer`` of h's requests in flight to it
    (SwarmPolicy's ready peers). The cheap tests; ``known`` (another host's row) comes after."""
    return not (backoff[h, j] > now or per_peer[h, j] >= max_per_peer or believed_dead[p] or load[p] >= 1.0)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(inline="always")
def _mix(z):
    """splitmix64's finaliser: every input bit moves every output bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def uniform(key, h, j):
    """The random draw of host h for its neighbour j in the round ``key``: a hash, uniform in [0, 1)
    with float32's 24 bits. Drawn only for the neighbours a loop scores, in any thread order, with
    the same result for any thread count."""
    z = _mix(np.uint64(key) + _GOLDEN * np.uint64(h + 1))
    return np.float64(_mix(z + _GOLDEN * np.uint64(j + 1)) >> np.uint64(40)) * (1.0 / (1 << 24))


@njit(cache=True)
def draws(key, rows, width):
    """``uniform`` for every (row, neighbour), as a matrix (what a test compares against)."""
    out = np.empty((len(rows), width))
    for i in range(len(rows)):
        for j in range(width):
            out[i, j] = uniform(key, rows[i], j)
    return out


def round_key(seed: int, step: int, rnd: int) -> np.uint64:
    """The key of request round ``rnd`` of time step ``step``: distinct draws for every round."""
    return np.uint64(_mix(np.uint64(((seed * 1_000_003 + step) * 64 + rnd) & (2**64 - 1))))


@njit(inline="always")
def _ready_peers(h, nbr, believed_dead, backoff, per_peer, load, now, max_per_peer, ready, n_ready, asked):
    """Host h's ready neighbours' positions (``_open``), in order, into ``ready[h, :n_ready[h]]``;
    returns how many. The first round of a step looks at every neighbour (``n_ready[h] < 0``); a
    later one only at the neighbour it asked since (``asked[h]``, set by ``ask``; -1: none): within a
    step a neighbour only stops being ready (asked up to the cap, or busy), and only by what a round
    changes: the back-off of, and the requests in flight to, the neighbour asked (liveness is decided
    before the rounds, loads are reported after)."""
    if n_ready[h] < 0:
        n = 0
        for j in range(nbr.shape[1]):
            if _open(h, j, nbr[h, j], now, backoff, per_peer, max_per_peer, believed_dead, load):
                ready[h, n] = j
                n += 1
        n_ready[h] = n
    elif asked[h] >= 0:
        j = asked[h]
        if backoff[h, j] > now or per_peer[h, j] >= max_per_peer:
            n = 0
            for i in range(n_ready[h]):
                if ready[h, i] != j:
                    ready[h, n] = ready[h, i]
                    n += 1
            n_ready[h] = n
    asked[h] = -1
    return n_ready[h]


@njit(inline="always")
def _best_source(h, c, cross, ready, key, nbr, known, nbr_slot, same_rack, per_peer, load):
    """SwarmPolicy._choose_source for host h: among its ``ready`` neighbours known to hold chunk c
    (any of them where c < 0), in its own rack or, where ``cross``, in others, the best
    ``source_score``; the load stands in for the throughput rank. -1 where there is none.
    ``nbr_slot``: each neighbour's bit in ``known`` (one load less per neighbour looked at)."""
    best, best_j = -np.inf, -1
    for q in range(len(ready)):                    # (an index loop: iterating the slice was slower)
        j = ready[q]
        near = same_rack[h, j]
        if not (near or cross):
            continue
        if c >= 0:
            b = nbr_slot[h, j]
            if ((known[c, b >> 6] >> np.uint64(b & 63)) & np.uint64(1)) == 0:
                continue
        p = nbr[h, j]
        score = _source_score(near, per_peer[h, j], uniform(key, h, j), 0.74 * (1.0 - min(load[p], 1.0)))
        if score > best:
            best, best_j = score, j
    return best_j


@njit(cache=True, parallel=True)
def pick_sources(rows, key, nbr, known, nbr_slot, same_rack, believed_dead, backoff, per_peer, load, now, max_per_peer,
                 ready, n_ready, asked, k_out):
    """For each row, the ready neighbour it would ask now for whatever it offers (SwarmPolicy's
    peer-first source): ``_best_source`` over any chunk; -1 where none is ready."""
    for i in prange(len(rows)):
        h = rows[i]
        n = _ready_peers(h, nbr, believed_dead, backoff, per_peer, load, now, max_per_peer, ready, n_ready, asked)
        k_out[i] = _best_source(h, -1, True, ready[h, :n], key, nbr, known, nbr_slot, same_rack, per_peer, load)


@njit(cache=True, parallel=True)
def count_announced(hosts, chunks, nbr, same_rack, believed_dead, alive, have, n_hosts, nb_cnt, nb_far, offered,
                    offered_n):
    """Bitmap pushes reach the neighbours: each (host, chunk) adds one known holder to every live
    neighbour's count (and to its other-rack count where the host is in another rack). Counted per
    receiving row, in parallel, over the announcements grouped by host: the neighbour graph is
    symmetric (``topology.build``), so a row's announcers are its own neighbours. A chunk whose
    count leaves zero joins the row's offered list (``offered[h, :offered_n[h]]``, ascending: the
    chunks some live neighbour is known to hold that the host lacked then), so a ranking walks only
    those (~75 ids a host at 10,000 hosts, where the ids below the announced front it lacks were
    ~137), in order (unordered, the ranking took 1.4x as long).
    Returns the rows whose list was full (rebuild them with ``list_offered``)."""
    start = np.zeros(n_hosts + 1, np.int64)
    for h in hosts:
        start[h + 1] += 1
    start = np.cumsum(start)
    fill = start[:-1].copy()
    by_host = np.empty(len(hosts), np.int64)
    for i in range(len(hosts)):
        by_host[fill[hosts[i]]] = chunks[i]
        fill[hosts[i]] += 1
    full = np.zeros(n_hosts, np.bool_)
    cap = offered.shape[1]
    for r in prange(n_hosts):
        listing = alive[r]
        for j in range(nbr.shape[1]):
            h = nbr[r, j]
            if h >= n_hosts or believed_dead[h]:
                continue
            for i in range(start[h], start[h + 1]):
                c = by_host[i]
                if nb_cnt[r, c] == 0 and listing and not have[r, c]:
                    pos = offered_n[r]
                    if pos == cap:
                        full[r] = True
                    else:
                        while pos > 0 and offered[r, pos - 1] > c:   # kept ascending: ~1 id a row
                            offered[r, pos] = offered[r, pos - 1]    # a step, near the top
                            pos -= 1
                        offered[r, pos] = c
                        offered_n[r] += 1
                nb_cnt[r, c] += 1
                if not same_rack[r, j]:
                    nb_far[r, c] += 1
    return np.flatnonzero(full)


@njit(cache=True, parallel=True)
def ask(h, c, k, now, nbr, alive, max_uploads, backoff_s, busy_backoff_s, u, n_up, backoff, src, chunk, left,
        nk, carry, pend, n_down, per_peer, asked):
    """Requests (host ``h[i]`` asks neighbour position ``k[i]`` for chunk ``c[i]``), at most one per
    host. A dead neighbour's connection fails (back-off ``backoff_s``); an uploader takes as many as
    it has free upload slots, in random order (``u[i]``: request i's draw), and the rest hear busy
    (``busy_backoff_s``). A taken request starts in the host's first free slot with the share its last
    flow left over. Uploaders answer in parallel, each its requests in call order: every request
    writes only its own host's rows, so the result is the one a single pass gives. ``asked[h]``: the
    neighbour each host asked (``_ready_peers`` re-checks it)."""
    n = len(h)
    s = np.empty(n, np.int64)
    start = np.zeros(len(n_up) + 1, np.int64)      # live requests grouped by uploader, in call order
    for i in range(n):
        s[i] = nbr[h[i], k[i]]
        asked[h[i]] = k[i]
        if alive[s[i]]:
            start[s[i] + 1] += 1
        else:
            backoff[h[i], k[i]] = now + backoff_s
    ups = 0
    for q in range(len(n_up)):
        ups += start[q + 1] > 0
        start[q + 1] += start[q]
    order = np.empty(start[-1], np.int64)
    fill = start[:-1].copy()
    up = np.empty(ups, np.int64)
    ups = 0
    for i in range(n):
        if alive[s[i]]:
            if fill[s[i]] == start[s[i]]:
                up[ups] = s[i]
                ups += 1
            order[fill[s[i]]] = i
            fill[s[i]] += 1
    slots = src.shape[1] - 1                       # the last slot is the origin read's
    for q in prange(ups):
        si = up[q]
        free = max_uploads - n_up[si]
        first, last = start[si], start[si + 1]
        for t in range(first, last):
            i = order[t]
            hi, ki = h[i], k[i]
            if u[i] * (last - t) >= free:          # selection sampling: a uniform random subset of the
                backoff[hi, ki] = now + busy_backoff_s    # requests, as many as it has free slots
                continue
            free -= 1
            slot = 0
            while slot < slots and src[hi, slot] >= 0:
                slot += 1
            src[hi, slot], chunk[hi, slot], left[hi, slot], nk[hi, slot] = si, c[i], 1.0 - carry[hi], ki
            carry[hi] = 0.0
            pend[hi, c[i]] = True
            n_down[hi] += 1
            per_peer[hi, ki] += 1
        n_up[si] = max_uploads - free


@njit(cache=True)
def end_flows(hs, ks, d, src, nk, n_up, n_down, per_peer):
    """Flows ``(hs[i], ks[i])`` are over (done, failed or given up): free their slots and counts
    (slot ``d`` is the host's origin read, which holds no peer download)."""
    for i in range(len(hs)):
        h, k = hs[i], ks[i]
        n_up[src[h, k]] -= 1
        if k < d:
            n_down[h] -= 1
            per_peer[h, nk[h, k]] -= 1
        src[h, k] = -1


@njit(cache=True)
def deliver(hs, ks, fin, moved, now, dt, d, n_hosts, n_chunks, origin, rack, src, chunk, left, nk, n_up, n_down,
            per_peer, carry, have, pend, count, lo, reached, imports, done_at):
    """The flows that finished this step (``fin``; ``moved``: each flow's share of it) deliver their
    chunks: when exactly each ended, the rest of the step's share to the host's next peer request,
    their slots freed, and for each chunk a host did not already have (two flows may bring the same
    one) the holdings, counts, cross-rack imports (``imports[chunk, rack]``), lowest missing chunk
    and finishing time. Returns the new (hosts, chunks), when each arrived, how many came from the
    origin and how many hosts finished."""
    idx = np.flatnonzero(fin)
    m = len(idx)
    fh, fk = hs[idx], ks[idx]
    fs, fc, t_end = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m)
    for j in range(m):
        h, k, mv = fh[j], fk[j], moved[idx[j]]
        fs[j], fc[j] = src[h, k], chunk[h, k]
        over = -left[h, k]                         # a flow that ends mid-step: when exactly, and the
        t_end[j] = now + dt * (1.0 - over / max(mv, 1e-12))   # rest goes to the next request (peerd
        if k < d:                                  # starts it at once; a step boundary must not idle it)
            carry[h] += min(over, mv)
    end_flows(fh, fk, d, src, nk, n_up, n_down, per_peer)
    new = np.empty(m, np.bool_)
    for j in range(m):
        new[j] = not have[fh[j], fc[j]]
    nh, nc, nt, ns = fh[new], fc[new], t_end[new], fs[new]
    from_origin = 0
    moves = np.zeros(len(nh), np.bool_)            # only a host's lowest missing chunk moves it on
    for j in range(len(nh)):
        h, c = nh[j], nc[j]
        have[h, c] = True
        pend[h, c] = False
        reached[c] = True
        count[h] += 1
        from_origin += ns[j] == origin
        if ns[j] < n_hosts and rack[ns[j]] != rack[h]:
            imports[c, rack[h]] += 1
        moves[j] = c == lo[h]
    for j in range(len(nh)):
        if moves[j]:
            h = nh[j]
            while lo[h] < n_chunks and have[h, lo[h]]:
                lo[h] += 1
    last = np.zeros(len(nh), np.bool_)
    for j in range(len(nh)):
        last[j] = count[nh[j]] == n_chunks and np.isnan(done_at[nh[j]])
    finished = 0
    for j in range(len(nh)):
        if last[j]:
            h = nh[j]
            if np.isnan(done_at[h]):
                finished += 1
                done_at[h] = nt[j]
            else:
                done_at[h] = max(done_at[h], nt[j])
    return nh, nc, nt, from_origin, finished


@njit(cache=True, parallel=True)
def next_entries(hosts, key, n_down, budget, plan, plan_ok, plan_ptr, have, pend, nbr, known, nbr_slot, same_rack,
                 rack_rank, rack_size, backup, reach, believed_dead, backoff, per_peer, load, now, max_per_peer, ready,
                 n_ready, asked):
    """One request round (SwarmPolicy.next_requests: "only chunks a ready peer holds are worth a
    look"): each host with a free download slot walks its plan from where it got to, past entries it
    has received or asked for meanwhile and entries no ready neighbour holds (across racks only where
    it may pull), to the first one some ready neighbour holds, and picks that chunk's source
    (``_best_source``). Returns (hosts, chunks, neighbour positions) of those found (each host is
    past its entry after the round: asked, or busy) and how many hosts still had entries to walk."""
    k = plan.shape[1]
    found = np.full(len(hosts), -1, np.int64)
    src = np.full(len(hosts), -1, np.int64)
    walked = np.zeros(len(hosts), np.bool_)
    for i in prange(len(hosts)):
        h = hosts[i]
        p = plan_ptr[h]
        if n_down[h] >= budget[h] or p >= k or not plan_ok[h, p]:
            continue
        walked[i] = True
        rank, n = rack_rank[h], rack_size[h]
        m = _ready_peers(h, nbr, believed_dead, backoff, per_peer, load, now, max_per_peer, ready, n_ready, asked)
        while p < k and plan_ok[h, p] and found[i] < 0:
            c = plan[h, p]
            p += 1
            if pend[h, c] or have[h, c]:
                continue
            cross = _reach_ok((rank - c) % n, n, backup[c], reach[c])
            j = _best_source(h, c, cross, ready[h, :m], key, nbr, known, nbr_slot, same_rack, per_peer, load)
            if j >= 0:
                found[i], src[i] = c, j
        plan_ptr[h] = p
    ok = found >= 0
    return hosts[ok], found[ok], src[ok], int(walked.sum())


@njit(cache=True)
def flow_rates(src, alive, up_cap, down_cap, origin):
    """Every flow in flight (host, slot, source; row by row) and its fair share this step: a dead
    uploader sends nothing; origin reads go first on a seeder's link."""
    n = 0
    for h in range(src.shape[0]):
        for k in range(src.shape[1]):
            n += src[h, k] >= 0
    hs, ks, s = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    i = 0
    for h in range(src.shape[0]):
        for k in range(src.shape[1]):
            if src[h, k] >= 0:
                hs[i], ks[i], s[i] = h, k, src[h, k]
                i += 1
    n_live = 0
    for i in range(n):
        n_live += alive[s[i]]
    live = np.empty(n_live, np.int64)
    j = 0
    for i in range(n):
        if alive[s[i]]:
            live[j] = i
            j += 1
    s_live = s[live]
    r_live = rates_with_priority(s_live, hs[live], up_cap, down_cap, s_live == origin)
    r = np.zeros(n)
    for j in range(n_live):
        r[live[j]] = r_live[j]
    return hs, ks, s, r


@njit(cache=True)
def move_flows(hs, ks, r, steps_per_chunk, left, n_hosts):
    """Each flow moves its share of a step: (chunks moved per flow, chunks received per host, which
    flows finished)."""
    moved = np.empty(len(hs))
    got = np.zeros(n_hosts)
    fin = np.empty(len(hs), np.bool_)
    for i in range(len(hs)):
        moved[i] = r[i] / steps_per_chunk
        left[hs[i], ks[i]] -= moved[i]
        got[hs[i]] += r[i]
        fin[i] = left[hs[i], ks[i]] <= 1e-9
    return moved, got, fin
