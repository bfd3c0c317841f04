"""Flow-level swarm simulator: drives the real ``SwarmPolicy`` over a fluid model of links.

Every request is a flow. Time advances in steps of ``1/steps_per_chunk`` of a chunk-time; in each
step a flow moves at the smallest of its fair shares: the uploader's link split among its flows, the
downloader's link split among its flows, and for cross-rack flows the racks' uplinks
(``hosts_per_rack * rate / oversubscription``) split likewise. That is how concurrent TCP flows
through token buckets behave in peerd. An uploader with ``upload_slots`` flows answers busy, as
peerd's ``max_uploads`` does. Bitmaps reach neighbours every ``have_interval`` seconds, as gossip
would; dead hosts are noticed after ``detect_s``. Each host's policy sees only its neighbours, like a
daemon with a bounded active peer set. The per-step arithmetic is vectorised over all flows; the
policy is called once per request and completion.
"""
from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from peerd.policy import ORIGIN, PolicyConfig, SwarmPolicy


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
    neighbors: int = 12
    seeders: int = 16
    have_interval: float = 0.5
    detect_s: float = 3.0
    max_inflight: int = 4
    max_per_peer: int = 2
    slow_factor: float = 0.25
    upload_slots: int = 4                 # concurrent uploads before answering busy (peerd's max_uploads)
    steps_per_chunk: int = 2
    seed: int = 1


def analytic_baselines(hosts: int, size: float, rate: float, origin_rate: float) -> dict:
    """Naive pull and a binary store-and-forward tree, for the same scenario."""
    lower = max(size / rate, size / origin_rate)
    depth = max(1, int(math.floor(math.log2(hosts))))
    return {"lower_bound_s": lower,
            "naive_pull_s": max(hosts * size / origin_rate, size / rate),
            "binary_tree_s": depth * 2 * size / rate,
            "tree_depth": depth}


def _neighbour_graph(cfg: SimConfig, rnd: random.Random, rack_of: list[int], by_rack: dict[int, list[int]]):
    """A near-regular random graph (every host about ``neighbors`` peers, so none is starved by a
    small peer set); two thirds of the edges stay inside a rack."""
    N, k = cfg.hosts, min(cfg.neighbors, cfg.hosts - 1)
    nbrs: list[set[int]] = [set() for _ in range(N)]

    def pair(stubs: list[int]) -> None:
        rnd.shuffle(stubs)
        for a, b in zip(stubs[::2], stubs[1::2]):
            if a != b:
                nbrs[a].add(b)
                nbrs[b].add(a)

    local = (2 * k) // 3 if cfg.racks > 1 else k
    for members in by_rack.values():
        pair([h for h in members for _ in range(min(local, len(members) - 1))])
    pair([h for h in range(N) for _ in range(k - local)])
    for h in range(N):            # top up hosts that lost edges to self-pairs and duplicates
        while len(nbrs[h]) < k:
            o = rnd.randrange(N)
            if o != h:
                nbrs[h].add(o)
                nbrs[o].add(h)
    return [sorted(x) for x in nbrs]


def simulate(cfg: SimConfig, progress=None) -> dict:
    wall0 = time.monotonic()
    rnd = random.Random(cfg.seed)
    origin_rate = cfg.origin_rate or cfg.rate
    n_chunks = max(1, math.ceil(cfg.size / cfg.chunk))
    N = cfg.hosts
    tau = cfg.chunk / cfg.rate
    dt = tau / cfg.steps_per_chunk
    rack_of = [h % cfg.racks for h in range(N)]
    rack_arr = np.array(rack_of + [-1])                     # index N is the origin
    names = [f"h{h}" for h in range(N)]
    index = {nm: h for h, nm in enumerate(names)}
    index[ORIGIN] = N
    by_rack: dict[int, list[int]] = {}
    for h in range(N):
        by_rack.setdefault(rack_of[h], []).append(h)
    seeders = tuple(names[h] for h in rnd.sample(range(N), min(cfg.seeders, N)))
    nbrs = _neighbour_graph(cfg, rnd, rack_of, by_rack)

    pcfg = PolicyConfig(max_inflight=cfg.max_inflight, max_per_peer=cfg.max_per_peer,
                        rack_grace_s=2.0, backoff_s=1.0, slow_factor=cfg.slow_factor)
    pols = []
    zeros = np.zeros(n_chunks, bool)
    for h in range(N):
        p = SwarmPolicy(me=names[h], n_chunks=n_chunks, rack=str(rack_of[h]), config=pcfg,
                        seed=cfg.seed * 100003 + h, seeders=seeders,
                        rack_members=tuple(names[o] for o in by_rack[rack_of[h]]))
        for o in nbrs[h]:
            p.peer_bitmap(names[o], zeros, 0.0, rack=str(rack_of[o]))
        pols.append(p)

    lower = max(cfg.size / cfg.rate, cfg.size / origin_rate)
    deaths = sorted((rnd.uniform(0.1, 0.9) * lower, h) for h in rnd.sample(range(N), int(cfg.fail_fraction * N)))
    alive = np.ones(N + 1, bool)
    done_at = np.full(N, np.nan)
    fresh: list[list[int]] = [[] for _ in range(N)]
    detect: list[tuple[float, int]] = []
    wakeups: list[tuple[float, int]] = []

    # flows live in per-host slots: K = peer requests + origin reads a host may have in flight
    K = cfg.max_inflight * pcfg.endgame_dups + pcfg.origin_inflight   # endgame duplicates included
    f_src = np.full((N, K), -1, np.int64)
    f_chunk = np.zeros((N, K), np.int64)
    f_left = np.zeros((N, K))
    f_start = np.zeros((N, K))
    slot_of: dict[tuple[int, int, int], int] = {}           # (host, chunk, src) -> slot
    up_cap = np.full(N + 1, 1.0)
    up_cap[N] = origin_rate / cfg.rate                      # in chunks per chunk-time
    rack_cap = (N / cfg.racks) / cfg.oversubscription
    host_of_slot = np.repeat(np.arange(N), K).reshape(N, K)
    origin_reads = cross_rack = transfers = 0
    next_have, next_tick, step = cfg.have_interval, 5.0, 0
    remaining = N
    poll = set(range(N))
    n_up = np.zeros(N + 1, np.int64)

    def issue(h: int, now: float) -> None:
        pol = pols[h]
        for _ in range(4):       # a busy answer comes back at once: ask again
            refused = False
            for r in pol.next_requests(now):
                s = index[r.source]
                if s != N and n_up[s] >= cfg.upload_slots:
                    pol.chunk_failed(r.chunk, r.source, "busy", now)
                    refused = True
                    continue
                k = int(np.flatnonzero(f_src[h] < 0)[0])
                f_src[h, k], f_chunk[h, k], f_left[h, k], f_start[h, k] = s, r.chunk, 1.0, now
                slot_of[(h, r.chunk, s)] = k
                n_up[s] += 1
            if not refused:
                break
        w = pol.wake_at(now)
        if w is not None:
            heapq.heappush(wakeups, (w, h))

    def end_flow(h: int, c: int, s: int) -> None:
        k = slot_of.pop((h, c, s), None)
        if k is not None:
            f_src[h, k] = -1
            n_up[s] -= 1

    def cancel(h: int, cancels) -> None:
        for x in cancels:
            end_flow(h, x.chunk, index[x.source])

    while remaining:
        now = step * dt
        while deaths and deaths[0][0] <= now:
            _, h = deaths.pop(0)
            alive[h] = False
            remaining -= 1
            for k in np.flatnonzero(f_src[h] >= 0):            # its own downloads stop
                n_up[f_src[h, k]] -= 1
                f_src[h, k] = -1
            slot_of_h = [key for key in slot_of if key[0] == h]
            for key in slot_of_h:
                del slot_of[key]
            heapq.heappush(detect, (now + cfg.detect_s, h))
        while detect and detect[0][0] <= now:
            _, h = heapq.heappop(detect)
            nb = set(nbrs[h])
            for o in range(N):
                if alive[o]:
                    if o in nb:
                        cancel(o, pols[o].peer_dead(names[h]))
                        poll.add(o)
                    else:
                        pols[o].member_dead(names[h])
        while wakeups and wakeups[0][0] <= now:
            poll.add(heapq.heappop(wakeups)[1])
        for h in poll:
            if alive[h] and not pols[h].complete:
                issue(h, now)
        poll = set()

        # fluid step: each flow at the smallest of its fair shares
        act = f_src >= 0
        src = f_src[act]
        if len(src):
            dst = host_of_slot[act]
            n_down = act.sum(axis=1)
            rate = np.minimum(up_cap[src] / n_up[src], 1.0 / n_down[dst])
            rate[~alive[src]] = 0.0                              # a dead uploader sends nothing
            cross = (rack_arr[src] != rack_arr[dst]) & (src != N)
            if cross.any():
                out_n = np.bincount(rack_arr[src][cross], minlength=cfg.racks)
                in_n = np.bincount(rack_arr[dst][cross], minlength=cfg.racks)
                rate[cross] = np.minimum(rate[cross], np.minimum(rack_cap / out_n[rack_arr[src][cross]],
                                                                 rack_cap / in_n[rack_arr[dst][cross]]))
            left = f_left[act] - rate / cfg.steps_per_chunk
            f_left[act] = left
            finished = np.flatnonzero(left <= 1e-9)
            end = now + dt
            if len(finished):
                hs, ks = np.nonzero(act)
                for i in finished:
                    h, k = int(hs[i]), int(ks[i])
                    s, c = int(f_src[h, k]), int(f_chunk[h, k])
                    end_flow(h, c, s)
                    cancel(h, pols[h].chunk_done(c, names[s] if s != N else ORIGIN, cfg.chunk, end - f_start[h, k], end))
                    fresh[h].append(c)
                    poll.add(h)
                    transfers += 1
                    if s == N:
                        origin_reads += 1
                    elif rack_of[s] != rack_of[h]:
                        cross_rack += 1
                    if pols[h].complete and np.isnan(done_at[h]):
                        done_at[h] = end
                        remaining -= 1
        step += 1
        now = step * dt
        if now >= next_have:
            next_have += cfg.have_interval
            for h in range(N):
                if fresh[h] and alive[h]:
                    for o in nbrs[h]:
                        if alive[o] and not pols[o].complete:
                            pols[o].peer_has(names[h], fresh[h], now)
                            poll.add(o)
                    fresh[h] = []
        if now >= next_tick:
            next_tick += 5.0
            for h in range(N):
                if alive[h] and not pols[h].complete:
                    pols[h].tick(now)
                    poll.add(h)
            if progress:
                progress(now, lower, int(np.sum(~np.isnan(done_at))), N)
        if now > 20 * lower:
            raise RuntimeError(f"simulation did not converge by {20 * lower:.0f} s: {remaining} hosts unfinished")

    surv = done_at[alive[:N]]
    p50, p90, mx = (float(np.percentile(surv, q)) for q in (50, 90, 100))
    size_bytes = n_chunks * cfg.chunk
    out = {"config": asdict(cfg), "chunks": n_chunks, "survivors": int(alive[:N].sum()),
           "died": N - int(alive[:N].sum()),
           **analytic_baselines(N, cfg.size, cfg.rate, origin_rate),
           "p50_s": p50, "p90_s": p90, "max_s": mx, "ratio": mx / lower,
           "origin_copies": origin_reads * cfg.chunk / size_bytes,
           "cross_rack_copies_per_chunk": cross_rack / n_chunks,
           "cross_rack_bytes": cross_rack * cfg.chunk,
           "transfers": transfers, "wall_s": time.monotonic() - wall0}
    out["naive_over_swarm"] = out["naive_pull_s"] / mx
    out["tree_over_swarm"] = out["binary_tree_s"] / mx
    return out
