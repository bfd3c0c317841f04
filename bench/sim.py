"""Flow-level swarm simulator at fleet scale (10,000 hosts x 6,250 chunks in minutes).

Every host runs the same decision rules as peerd's ``SwarmPolicy``, evaluated for all hosts at once
through the batched functions in ``peerd/choice.py`` that the daemon's policy calls with one row:
rarest-first (by the count of neighbours holding a chunk) inside a window of the lowest missing
chunks with a per-host random tie-break, sources ranked same rack first, cross-rack pulls only for a
host's import stripe or after the rack grace, origin reads striped over the seeders and only for
chunks no live host holds.

The network is a fluid model. Each request is a flow; in each time step (a fraction of a
chunk-time) flows get a max-min-like fair share of the uploader's link, the downloader's link and,
across racks, both racks' uplinks (``hosts_per_rack * rate / oversubscription``): a first share
``min(up/n_up, down/n_down)``, then flows whose links both have room are scaled up into it. That is
how concurrent TCP flows through token buckets behave in peerd. An uploader with ``upload_slots``
flows takes no more (peerd answers 503 busy); a requester only asks neighbours it knows to have
the chunk, as it learns from HAVE gossip every ``have_interval``.

Hosts die at random times (``fail_fraction``). A dead host's in-flight uploads stall until its
peers notice (``detect_s``) and then fail; the downloaders ask elsewhere. Nothing is sent to a dead
host once it is dead (its connections refuse).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from bench.links import max_min_rates, scale_to_caps
from peerd.choice import origin_order, rank_window, source_scores, tiebreak_params


@dataclass
class SimConfig:
    hosts: int = 1000
    size: float = 400e9
    chunk: int = 64 * 1024 * 1024
    rate: float = 10e9 / 8                # bytes/s, each host, up and down
    origin_rate: float | None = None      # bytes/s the origin serves in total (default: rate)
    racks: int = 20
    oversubscription: float = 1.0
    fail_fraction: float = 0.05
    neighbors: int = 16
    cross_rack_neighbors: int = 6         # of those, in other racks (peerd: max_cross_rack_peers); 2 on oversubscribed racks
    seeders: int = 16
    origin_spread: int = 1                # stripe positions per origin block (peerd: 4); in order here because
                                          # the sim's 128-chunk window needs it at 10,000 hosts (docs/peerd.md)
    have_interval: float = 0.1
    detect_s: float = 3.0
    max_inflight: int = 8                 # peer downloads per host
    max_per_peer: int = 2
    upload_slots: int = 8                 # concurrent uploads before answering busy (peerd's max_uploads)
    window: int = 128                     # chunks ranked per host (lowest missing onwards)
    candidates: int = 12                  # best-ranked chunks kept per host between re-plans
    request_rounds: int = 6               # rounds of (choose, ask, busy?) per time step
    peer_first_rounds: int = 2            # rounds of asking an idle neighbour for its rarest chunk
    rack_grace_s: float = 0.3             # a non-importer waits this long before pulling across racks
    steps_per_chunk: int = 1
    seed: int = 1


def analytic_baselines(hosts: int, size: float, rate: float, origin_rate: float) -> dict:
    """Naive pull and a binary store-and-forward tree, for the same scenario."""
    lower = max(size / rate, size / origin_rate)
    depth = max(1, int(math.floor(math.log2(hosts))))
    return {"lower_bound_s": lower,
            "naive_pull_s": max(hosts * size / origin_rate, size / rate),
            "binary_tree_s": depth * 2 * size / rate,
            "tree_depth": depth}


def _neighbour_graph(cfg: SimConfig, rnd: random.Random, by_rack: dict[int, list[int]]) -> np.ndarray:
    """A near-regular random graph as an (N, k) array padded with N (a host that holds nothing):
    every host has about ``neighbors`` peers, ``cross_rack_neighbors`` of them in other racks."""
    N, k = cfg.hosts, min(cfg.neighbors, cfg.hosts - 1)
    nbrs: list[set[int]] = [set() for _ in range(N)]

    def pair(stubs: list[int]) -> None:
        rnd.shuffle(stubs)
        for a, b in zip(stubs[::2], stubs[1::2]):
            if a != b:
                nbrs[a].add(b)
                nbrs[b].add(a)

    local = max(k - cfg.cross_rack_neighbors, 0) if cfg.racks > 1 else k
    for members in by_rack.values():
        pair([h for h in members for _ in range(min(local, len(members) - 1))])
    pair([h for h in range(N) for _ in range(k - local)])
    for h in range(N):            # top up hosts that lost edges to self-pairs and duplicates
        while len(nbrs[h]) < k:
            o = rnd.randrange(N)
            if o != h:
                nbrs[h].add(o)
                nbrs[o].add(h)
    width = max(len(x) for x in nbrs)
    out = np.full((N, width), N, np.int64)
    for h, x in enumerate(nbrs):
        out[h, :len(x)] = sorted(x)
    return out


class _Flows:
    """In-flight requests in per-host slots: ``src[h, k]`` (-1 free), chunk, bytes left (in chunks)."""

    def __init__(self, n: int, slots: int):
        self.src = np.full((n, slots), -1, np.int64)
        self.chunk = np.zeros((n, slots), np.int64)
        self.left = np.zeros((n, slots))
        self.nk = np.zeros((n, slots), np.int64)    # the source's position in the host's neighbour list

    def free_slot(self, hosts: np.ndarray, first: int, last: int) -> np.ndarray:
        """The first free slot in ``[first, last)`` for each host (they must have one)."""
        return first + np.argmax(self.src[hosts, first:last] < 0, axis=1)


def simulate(cfg: SimConfig, progress=None) -> dict:
    wall0 = time.monotonic()
    rnd = random.Random(cfg.seed)
    nrng = np.random.default_rng(cfg.seed)
    origin_rate = cfg.origin_rate or cfg.rate
    C = max(1, math.ceil(cfg.size / cfg.chunk))
    N, W = cfg.hosts, cfg.window
    D, U = cfg.max_inflight, cfg.upload_slots
    ORG = N + 1                                    # source index of the origin; N is "nobody"
    tau = cfg.chunk / cfg.rate
    dt = tau / cfg.steps_per_chunk
    rack = np.array([h % cfg.racks for h in range(N)] + [-1, -2])
    by_rack: dict[int, list[int]] = {}
    for h in range(N):
        by_rack.setdefault(int(rack[h]), []).append(h)
    rack_rank = np.zeros(N, np.int64)              # this host's import stripe inside its rack
    rack_size = np.zeros(N, np.int64)
    for members in by_rack.values():
        rack_rank[members] = np.arange(len(members))
        rack_size[members] = len(members)
    sizes, size_idx = np.unique(rack_size, return_inverse=True)
    stripe = np.arange(C + W)[None, :] % sizes[:, None]   # chunk -> importer rank, per rack size
    nbr = _neighbour_graph(cfg, rnd, by_rack)
    same_rack = rack[nbr] == rack[:N, None]
    nbr_row = nbr * (C + W)                        # flat offsets of the neighbours' rows
    per_peer = np.zeros(nbr.shape, np.int64)       # my requests in flight to each neighbour
    tb_a, tb_b = tiebreak_params(nrng, N)

    have = np.zeros((N + 1, C + W), bool)
    have[:, C:] = True                             # padding: the window never runs off the end
    have_flat = have.reshape(-1)                   # views for flat gathers
    pend = np.zeros((N, C + W), bool)
    nb_cnt = np.zeros((N, C + W), np.uint8)        # live neighbours known to hold each chunk
    glob = np.zeros(C, np.int64)                   # live holders, fleet-wide
    born = np.full(C + W, np.inf)                  # when each chunk first reached the fleet
    lo = np.zeros(N, np.int64)
    count = np.zeros(N, np.int64)
    alive = np.ones(N + 2, bool)
    alive[N] = False
    done_at = np.full(N, np.nan)
    seeders = np.array(sorted(rnd.sample(range(N), min(cfg.seeders, N))))
    origin_pend = np.zeros(C, bool)

    SL = D + 1                                     # slot D is the host's origin read
    fl = _Flows(N, SL)
    n_up = np.zeros(N + 2, np.int64)
    n_down = np.zeros(N, np.int64)                 # peer downloads
    plan = np.zeros((N, cfg.candidates), np.int64)  # each host's ranked chunks, and how far it got
    plan_ok = np.zeros((N, cfg.candidates), bool)
    plan_ptr = np.full(N, cfg.candidates)
    carry = np.zeros(N)                            # download share left over by flows that ended mid-step
    up_cap = np.full(N + 2, 1.0)
    up_cap[ORG] = origin_rate / cfg.rate           # capacities in chunks per chunk-time
    down_cap = np.ones(N)
    rack_caps = np.full(cfg.racks, (N / cfg.racks) / cfg.oversubscription)

    lower = max(cfg.size / cfg.rate, cfg.size / origin_rate)
    deaths = sorted((rnd.uniform(0.1, 0.9) * lower, h) for h in rnd.sample(range(N), int(cfg.fail_fraction * N)))
    detect: list[tuple[float, int]] = []
    announce_h: list[np.ndarray] = []
    announce_c: list[np.ndarray] = []
    origin_reads = cross_rack = transfers = 0
    ar_w = np.arange(W)
    next_have, next_progress, step = cfg.have_interval, 0.0, 0
    remaining = N
    gossiped = True
    util_sum, util_steps, warm_s = 0.0, 0, math.nan
    origin_done = math.nan

    def flush_gossip() -> None:
        if not announce_h:
            return
        h, c = np.concatenate(announce_h), np.concatenate(announce_c)
        announce_h.clear()
        announce_c.clear()
        rows = nbr[h]
        ok = rows < N
        flat, n = np.unique((rows * (C + W) + c[:, None])[ok], return_counts=True)
        nb_cnt.reshape(-1)[flat] += n.astype(np.uint8)   # unique + add: ~10x faster than add.at here

    def end_flows(hs: np.ndarray, ks: np.ndarray) -> None:
        s = fl.src[hs, ks]
        n_up[:] -= np.bincount(s, minlength=N + 2)
        peer = ks < D
        n_down[:] -= np.bincount(hs[peer], minlength=N)
        pp = per_peer.ravel()                      # a view: update in place
        pp -= np.bincount(hs[peer] * per_peer.shape[1] + fl.nk[hs[peer], ks[peer]], minlength=len(pp)).astype(pp.dtype)
        fl.src[hs, ks] = -1

    def advance_lo(hs: np.ndarray) -> None:
        while len(hs):
            seg = have[hs[:, None], lo[hs][:, None] + ar_w]
            first = np.argmin(seg, axis=1)
            full = seg[np.arange(len(hs)), first]   # every column held: move a whole window on
            lo[hs] = np.minimum(lo[hs] + np.where(full, W, first), C)
            hs = hs[full & (lo[hs] < C)]

    def assign_origin(now: float) -> None:
        live = seeders[alive[seeders]]
        if len(live) == 0:
            return
        free = live[fl.src[live, D] < 0]
        if len(free) == 0:
            return
        need = np.flatnonzero((glob == 0) & ~origin_pend)
        for s in free:
            stripe = need[need % len(live) == np.searchsorted(live, s)]
            stripe = stripe[~have[s, stripe] & ~pend[s, stripe]]
            if len(stripe):
                c = int(origin_order(stripe, len(live), cfg.origin_spread, tb_a, tb_b, s)[0])
                fl.src[s, D], fl.chunk[s, D], fl.left[s, D] = ORG, c, 1.0
                origin_pend[c] = True
                pend[s, c] = True
                n_up[ORG] += 1

    def start_flows(h: np.ndarray, c: np.ndarray, k: np.ndarray) -> None:
        """Requests (host, chunk, neighbour position), at most one per host: an uploader takes as
        many as it has free slots, in random order; the rest hear "busy" and retry."""
        s = nbr[h, k]
        order = np.lexsort((nrng.random(len(s)), s))
        h, c, k, s = h[order], c[order], k[order], s[order]
        first_of = np.searchsorted(s, s, side="left")
        take = (np.arange(len(s)) - first_of) < (U - n_up[s])
        h, c, k, s = h[take], c[take], k[take], s[take]
        slot = fl.free_slot(h, 0, D)
        fl.src[h, slot], fl.chunk[h, slot], fl.left[h, slot], fl.nk[h, slot] = s, c, 1.0 - carry[h], k
        carry[h] = 0
        pend[h, c] = True
        n_up[:N] += np.bincount(s, minlength=N)
        n_down[h] += 1
        per_peer[h, k] += 1

    def pick_source(h: np.ndarray, holds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each host, the best neighbour among ``holds`` that would take one more request now:
        (neighbour position, found). What a host's throughput tracking tells it about a neighbour
        is modelled by the neighbour's load: an uploader with fewer flows sends each one faster."""
        peers = nbr[h]
        load = n_up[peers]
        mine = per_peer[h]
        holds = holds & alive[peers] & (load < U) & (mine < cfg.max_per_peer)
        k = np.argmax(source_scores(holds, same_rack[h], mine, nrng, 1.0 - load / (U + 1)), axis=1)
        return k, holds[np.arange(len(h)), k]

    def cross_ok(h: np.ndarray, c: np.ndarray, now: float) -> np.ndarray:
        """A pull across racks: for the host's import stripe, or once the chunk has been around
        for the grace (SwarmPolicy._cross_ok)."""
        hh = h[:, None] if c.ndim == 2 else h
        return (stripe[size_idx[hh], c] == rack_rank[hh]) | (born[c] <= now - cfg.rack_grace_s)

    def assign_peers(now: float, replan: bool) -> None:
        hosts = np.flatnonzero(alive[:N] & np.isnan(done_at) & (n_down < D))
        if len(hosts) == 0:
            return
        # rank afresh after gossip (the only time holder counts change) or when a host's list ran dry
        stale = hosts if replan else hosts[plan_ptr[hosts] >= cfg.candidates]
        if len(stale):
            cols = lo[stale][:, None] + ar_w
            flat = stale[:, None] * (C + W) + cols      # one flat gather per matrix (rows < N line up)
            plan[stale], plan_ok[stale] = rank_window(
                ~np.take(have_flat, flat) & ~np.take(pend.ravel(), flat), np.take(nb_cnt.ravel(), flat),
                cols, tb_a, tb_b[stale], cfg.candidates)
            plan_ptr[stale] = 0
        for _ in range(cfg.request_rounds):
            h = hosts[(n_down[hosts] < D) & (plan_ptr[hosts] < cfg.candidates)]
            h = h[plan_ok[h, plan_ptr[h]]]
            if len(h) == 0:
                break
            c = plan[h, plan_ptr[h]]
            gone = pend[h, c] | have[h, c]
            plan_ptr[h[gone]] += 1
            h, c = h[~gone], c[~gone]
            holds = np.take(have_flat, nbr_row[h] + c[:, None]) & (same_rack[h] | cross_ok(h, c, now)[:, None])
            k, found = pick_source(h, holds)
            plan_ptr[h[~found]] += 1
            if found.any():
                start_flows(h[found], c[found], k[found])
        # the rarest chunks' holders are all busy: ask an idle neighbour for the rarest chunk it
        # has (SwarmPolicy._peer_first)
        for _ in range(cfg.peer_first_rounds):
            h = hosts[(n_down[hosts] < D)]
            if len(h) == 0:
                break
            k, found = pick_source(h, np.ones(nbr[h].shape, bool))
            h, k = h[found], k[found]
            if len(h) == 0:
                break
            s = nbr[h, k]
            cols = lo[h][:, None] + ar_w
            fh, fs = h[:, None] * (C + W) + cols, s[:, None] * (C + W) + cols
            want = ~np.take(have_flat, fh) & ~np.take(pend.ravel(), fh) & np.take(have_flat, fs)
            far = ~same_rack[h, k]
            if far.any():
                want[far] &= cross_ok(h[far], cols[far], now)
            cand, ok = rank_window(want, np.maximum(np.take(nb_cnt.ravel(), fh), 1), cols, tb_a, tb_b[h], 1)
            ok = ok[:, 0]
            if not ok.any():
                break
            start_flows(h[ok], cand[ok, 0], k[ok])

    while remaining:
        now = step * dt
        while deaths and deaths[0][0] <= now:
            _, h = deaths.pop(0)
            flush_gossip()                         # what it announced went out before it died
            alive[h] = False
            remaining -= 1
            if fl.src[h, D] == ORG:                # its origin read is lost: another seeder takes it
                origin_pend[fl.chunk[h, D]] = False
            ks = np.flatnonzero(fl.src[h] >= 0)
            end_flows(np.full(len(ks), h), ks)
            detect.append((now + cfg.detect_s, h))
        while detect and detect[0][0] <= now:
            _, h = detect.pop(0)
            rows = nbr[h][nbr[h] < N]
            nb_cnt[rows, :C] -= have[h, :C]
            glob[:] -= have[h, :C]
            hs, ks = np.nonzero(fl.src == h)       # its stalled uploads fail now
            pend[hs, fl.chunk[hs, ks]] = False
            end_flows(hs, ks)
        assign_origin(now)
        assign_peers(now, gossiped)
        gossiped = False
        carry[:] = 0                               # a share not taken up by a new request is lost

        # fluid step
        hs, ks = np.nonzero(fl.src >= 0)
        if len(hs):
            s = fl.src[hs, ks]
            live = alive[s]
            r = np.zeros(len(s))
            r[live] = max_min_rates(s[live], hs[live], up_cap, down_cap)   # a dead uploader sends nothing
            cross = (rack[s] != rack[hs]) & (s < N)
            if cross.any() and cfg.oversubscription > 1:
                r[cross] = scale_to_caps(r[cross], [(rack[s[cross]], rack_caps), (rack[hs[cross]], rack_caps)])
            moved = r / cfg.steps_per_chunk
            fl.left[hs, ks] -= moved
            busy_hosts = np.isnan(done_at) & alive[:N]
            if busy_hosts.any():              # the mean download utilisation of unfinished hosts
                u = float(np.bincount(hs, r, minlength=N)[busy_hosts].mean())
                util_sum, util_steps = util_sum + u, util_steps + 1
                if math.isnan(warm_s) and u >= 0.95:
                    warm_s = now
            fin = fl.left[hs, ks] <= 1e-9
            if fin.any():
                fh, fk = hs[fin], ks[fin]
                fs, fc = fl.src[fh, fk], fl.chunk[fh, fk]
                # a flow that ends mid-step: when exactly, and the rest of the step's share goes to
                # the host's next request (peerd starts it at once; a step boundary must not idle it)
                over = -fl.left[fh, fk]
                t_end = now + dt * (1 - over / np.maximum(moved[fin], 1e-12))
                peer = fk < D
                np.add.at(carry, fh[peer], np.minimum(over[peer], moved[fin][peer]))
                end_flows(fh, fk)
                first = np.isinf(born[fc])
                np.minimum.at(born, fc, t_end)
                if first.any() and not np.isinf(born[:C]).any():
                    origin_done = float(born[:C].max())
                new = ~have[fh, fc]
                fh, fc, fs, t_end = fh[new], fc[new], fs[new], t_end[new]
                have[fh, fc] = True
                pend[fh, fc] = False
                glob += np.bincount(fc, minlength=C)
                count += np.bincount(fh, minlength=N)
                origin_pend[fc[fs == ORG]] = False
                transfers += len(fh)
                origin_reads += int((fs == ORG).sum())
                cross_rack += int(((fs < N) & (rack[np.minimum(fs, N)] != rack[fh])).sum())
                announce_h.append(fh)
                announce_c.append(fc)
                advance_lo(np.unique(fh[fc == lo[fh]]))   # only a host's lowest missing chunk moves it
                last = (count[fh] == C) & np.isnan(done_at[fh])
                np.fmax.at(done_at, fh[last], t_end[last])
                remaining -= len(np.unique(fh[last]))
        step += 1
        now = step * dt
        if now >= next_have:
            next_have += cfg.have_interval
            flush_gossip()
            gossiped = True
        if progress and now >= next_progress:
            next_progress += lower / 100
            progress(now, lower, int(np.sum(~np.isnan(done_at))), N)
        if now > 20 * lower:
            raise RuntimeError(f"simulation did not converge by {20 * lower:.0f} s: {remaining} hosts unfinished")

    surv = done_at[alive[:N]]
    p50, p90, mx = (float(np.percentile(surv, q)) for q in (50, 90, 100))
    size_bytes = C * cfg.chunk
    out = {"config": asdict(cfg), "chunks": C, "survivors": int(alive[:N].sum()),
           "died": N - int(alive[:N].sum()),
           **analytic_baselines(N, cfg.size, cfg.rate, origin_rate),
           "origin_done_s": origin_done, "p50_s": p50, "p90_s": p90, "max_s": mx, "ratio": mx / lower, "p50_ratio": p50 / lower,
           "origin_copies": origin_reads * cfg.chunk / size_bytes,
           "cross_rack_copies_per_chunk": cross_rack / C,
           "cross_rack_bytes": cross_rack * cfg.chunk,
           "mean_download_utilisation": util_sum / max(util_steps, 1),
           "warm_up_s": warm_s,                   # until unfinished hosts first download at >= 95 %
           "transfers": transfers, "steps": step, "wall_s": time.monotonic() - wall0}
    out["naive_over_swarm"] = out["naive_pull_s"] / mx
    out["tree_over_swarm"] = out["binary_tree_s"] / mx
    return out
