"""Flow-level swarm simulator: drives the real ``SwarmPolicy`` over a slotted model of links.

Time advances in slots of one chunk-time at the host link rate (``chunk / rate``). In each slot every
host may download and upload about one chunk (fractional credits model other rates), the origin
serves ``origin_rate`` worth, and cross-rack transfers also spend their racks' uplink credit
(``hosts_per_rack * rate / oversubscription``). Bitmaps reach neighbours every ``have_interval``
seconds, as gossip would; dead hosts are noticed after ``detect_s``. Each host's policy sees only its
neighbours, like a daemon with a bounded active peer set.
"""
from __future__ import annotations

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
    have_interval: float = 1.0
    detect_s: float = 3.0
    attempts_per_slot: int = 4
    seed: int = 1


def analytic_baselines(hosts: int, size: float, rate: float, origin_rate: float) -> dict:
    """Naive pull and a binary store-and-forward tree, for the same scenario."""
    lower = max(size / rate, size / origin_rate)
    depth = max(1, int(math.floor(math.log2(hosts))))
    return {"lower_bound_s": lower,
            "naive_pull_s": max(hosts * size / origin_rate, size / rate),
            "binary_tree_s": depth * 2 * size / rate,
            "tree_depth": depth}


def simulate(cfg: SimConfig, progress=None) -> dict:
    wall0 = time.monotonic()
    rnd = random.Random(cfg.seed)
    origin_rate = cfg.origin_rate or cfg.rate
    n_chunks = max(1, math.ceil(cfg.size / cfg.chunk))
    N = cfg.hosts
    tau = cfg.chunk / cfg.rate
    rack_of = [h % cfg.racks for h in range(N)]
    names = [f"h{h}" for h in range(N)]
    index = {nm: h for h, nm in enumerate(names)}
    members_by_rack: dict[int, list[str]] = {}
    for h in range(N):
        members_by_rack.setdefault(rack_of[h], []).append(names[h])
    seeders = tuple(names[h] for h in rnd.sample(range(N), min(cfg.seeders, N)))

    # a symmetric random neighbour graph, two thirds of the edges inside the rack
    nbrs: list[set[int]] = [set() for _ in range(N)]
    for h in range(N):
        same = members_by_rack[rack_of[h]]
        for j in range(max(1, cfg.neighbors // 2)):
            if j % 3 != 2 and len(same) > 1:
                o = index[rnd.choice(same)]
            else:
                o = rnd.randrange(N)
            if o != h:
                nbrs[h].add(o)
                nbrs[o].add(h)

    pcfg = PolicyConfig(max_inflight=1, max_per_peer=1, origin_inflight=1, rack_grace_s=2.0)
    pols = []
    zeros = np.zeros(n_chunks, bool)
    for h in range(N):
        p = SwarmPolicy(me=names[h], n_chunks=n_chunks, rack=str(rack_of[h]), config=pcfg, seed=cfg.seed * 100003 + h,
                        seeders=seeders, rack_members=tuple(members_by_rack[rack_of[h]]))
        for o in nbrs[h]:
            p.peer_bitmap(names[o], zeros, 0.0, rack=str(rack_of[o]))
        pols.append(p)

    lower = max(cfg.size / cfg.rate, cfg.size / origin_rate)
    deaths = sorted((rnd.uniform(0.1, 0.9) * lower, h) for h in rnd.sample(range(N), int(cfg.fail_fraction * N)))
    alive = np.ones(N, bool)
    done_at = np.full(N, np.nan)
    fresh: list[list[int]] = [[] for _ in range(N)]
    detect_queue: list[tuple[float, int]] = []
    up_rate = 1.0                       # chunks per slot at the host rate
    origin_per_slot = origin_rate / cfg.rate
    hosts_per_rack = N / cfg.racks
    rack_per_slot = hosts_per_rack / cfg.oversubscription
    origin_reads = cross_rack = transfers = 0
    next_have = cfg.have_interval
    next_tick = 5.0
    slot = 0
    active = list(range(N))
    origin_credit = 0.0
    while active:
        now = slot * tau
        while deaths and deaths[0][0] <= now:
            _, h = deaths.pop(0)
            alive[h] = False
            detect_queue.append((now + cfg.detect_s, h))
        while detect_queue and detect_queue[0][0] <= now:
            _, h = detect_queue.pop(0)
            for o in range(N):
                if alive[o]:
                    if o in nbrs[h]:
                        pols[o].peer_dead(names[h])
                    else:
                        pols[o].member_dead(names[h])
        up = np.full(N, up_rate)
        origin_credit = min(origin_credit + origin_per_slot, max(1.0, origin_per_slot))
        rack_out = np.full(cfg.racks, rack_per_slot)
        rack_in = np.full(cfg.racks, rack_per_slot)
        completions = []
        rnd.shuffle(active)
        for h in active:
            pol = pols[h]
            for _ in range(cfg.attempts_per_slot):
                reqs = pol.next_requests(now)
                if not reqs:
                    break
                granted = False
                for r in reqs:
                    if r.source == ORIGIN:
                        if origin_credit >= 1.0:
                            origin_credit -= 1.0
                            completions.append((h, r.chunk, r.source))
                            granted = True
                        else:
                            pol.chunk_failed(r.chunk, r.source, "busy", now)
                        continue
                    s = index[r.source]
                    if not alive[s]:
                        pol.chunk_failed(r.chunk, r.source, "error", now)
                        continue
                    rs, rh = rack_of[s], rack_of[h]
                    if up[s] < 1.0 or (rs != rh and (rack_out[rs] < 1.0 or rack_in[rh] < 1.0)):
                        pol.chunk_failed(r.chunk, r.source, "busy", now)
                        continue
                    up[s] -= 1.0
                    if rs != rh:
                        rack_out[rs] -= 1.0
                        rack_in[rh] -= 1.0
                    completions.append((h, r.chunk, r.source))
                    granted = True
                if granted:
                    break
        end = now + tau
        for h, c, src in completions:
            if not alive[h]:
                continue
            pols[h].chunk_done(c, src, cfg.chunk, tau, end)
            fresh[h].append(c)
            transfers += 1
            if src == ORIGIN:
                origin_reads += 1
            elif rack_of[index[src]] != rack_of[h]:
                cross_rack += 1
        slot += 1
        now = slot * tau
        if now >= next_have:
            next_have += cfg.have_interval
            for h in range(N):
                if fresh[h] and alive[h]:
                    for o in nbrs[h]:
                        if alive[o]:
                            pols[o].peer_has(names[h], fresh[h], now)
                    fresh[h] = []
        if now >= next_tick:
            next_tick += 5.0
            for h in active:
                pols[h].tick(now)
            if progress:
                progress(now, lower, int(np.sum(~np.isnan(done_at))), N)
        still = []
        for h in active:
            if not alive[h]:
                continue
            if pols[h].complete:
                done_at[h] = now
            else:
                still.append(h)
        active = still
        if slot * tau > 20 * lower:
            raise RuntimeError(f"simulation did not converge by {20 * lower:.0f} s: {len(active)} hosts unfinished")

    surv = done_at[alive]
    p50, p90, mx = (float(np.percentile(surv, q)) for q in (50, 90, 100))
    size_bytes = n_chunks * cfg.chunk
    out = {"config": asdict(cfg), "chunks": n_chunks, "survivors": int(alive.sum()), "died": int((~alive).sum()),
           **analytic_baselines(N, cfg.size, cfg.rate, origin_rate),
           "p50_s": p50, "p90_s": p90, "max_s": mx, "ratio": mx / lower,
           "origin_copies": origin_reads * cfg.chunk / size_bytes,
           "cross_rack_copies_per_chunk": cross_rack / n_chunks,
           "cross_rack_bytes": cross_rack * cfg.chunk,
           "transfers": transfers, "wall_s": time.monotonic() - wall0}
    out["naive_over_swarm"] = out["naive_pull_s"] / mx
    out["tree_over_swarm"] = out["binary_tree_s"] / mx
    return out
