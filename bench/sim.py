"""Flow-level swarm simulator: drives the real ``SwarmPolicy`` over a slotted model of links.

Time advances in slots of one chunk-time at the host link rate (``chunk / rate``). Requests queue at
their uploader (as they would on a TCP connection); each slot every uploader sends about one chunk
from its queue (fractional credits model other rates) to a host whose download link still has room
this slot, the origin serves ``origin_rate`` worth of its queue, and cross-rack transfers also spend
their racks' uplink credit (``hosts_per_rack * rate / oversubscription``). Bitmaps reach neighbours
every ``have_interval`` seconds, as gossip would; dead hosts are noticed after ``detect_s``. Each
host's policy sees only its neighbours, like a daemon with a bounded active peer set.
"""
from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
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
    upload_queue: int = 4                 # requests an uploader accepts before answering busy (peerd's max_uploads)
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


def simulate(cfg: SimConfig, progress=None, debug: list | None = None) -> dict:
    wall0 = time.monotonic()
    rnd = random.Random(cfg.seed)
    origin_rate = cfg.origin_rate or cfg.rate
    n_chunks = max(1, math.ceil(cfg.size / cfg.chunk))
    N = cfg.hosts
    tau = cfg.chunk / cfg.rate
    rack_of = [h % cfg.racks for h in range(N)]
    names = [f"h{h}" for h in range(N)]
    index = {nm: h for h, nm in enumerate(names)}
    by_rack: dict[int, list[int]] = {}
    for h in range(N):
        by_rack.setdefault(rack_of[h], []).append(h)
    seeders = tuple(names[h] for h in rnd.sample(range(N), min(cfg.seeders, N)))
    nbrs = _neighbour_graph(cfg, rnd, rack_of, by_rack)

    pcfg = PolicyConfig(max_inflight=cfg.max_inflight, max_per_peer=cfg.max_per_peer, origin_inflight=2,
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
    alive = [True] * N
    done_at = np.full(N, np.nan)
    fresh: list[list[int]] = [[] for _ in range(N)]
    detect: list[tuple[float, int]] = []
    queues: list[deque] = [deque() for _ in range(N)]      # requests waiting at each uploader
    origin_q: deque = deque()
    live_req: set[tuple[int, int, str]] = set()            # (host, chunk, source) still wanted
    issued_at: dict[tuple[int, int, str], float] = {}
    busy_uploaders: set[int] = set()
    origin_reads = cross_rack = transfers = 0
    next_have, next_tick, slot = cfg.have_interval, 5.0, 0
    poll = set(range(N))                                   # hosts that may have new requests to make
    origin_per_slot = origin_rate / cfg.rate
    rack_cap = (N / cfg.racks) / cfg.oversubscription
    origin_credit = 0.0
    remaining = N

    wakeups: list[tuple[float, int]] = []

    def issue(h: int, now: float) -> None:
        pol = pols[h]
        for _ in range(4):       # a busy answer comes back at once: ask again within the slot
            if not _issue_once(h, pol, now):
                break
        w = pol.wake_at(now)
        if w is not None:
            heapq.heappush(wakeups, (w, h))

    def _issue_once(h: int, pol: SwarmPolicy, now: float) -> bool:
        refused = False
        for r in pol.next_requests(now):
            key = (h, r.chunk, r.source)
            if r.source == ORIGIN:
                origin_q.append(key)
            else:
                s = index[r.source]
                if len(queues[s]) >= cfg.upload_queue:
                    pol.chunk_failed(r.chunk, r.source, "busy", now)
                    refused = True
                    continue
                queues[s].append(key)
                busy_uploaders.add(s)
            live_req.add(key)
            issued_at[key] = now
        return refused

    def drop(h: int, cancels) -> None:
        for c in cancels:
            live_req.discard((h, c.chunk, c.source))

    while remaining:
        now = slot * tau
        while deaths and deaths[0][0] <= now:
            _, h = deaths.pop(0)
            alive[h] = False
            remaining -= 1
            heapq.heappush(detect, (now + cfg.detect_s, h))
        while detect and detect[0][0] <= now:
            _, h = heapq.heappop(detect)
            nb = set(nbrs[h])
            for o in range(N):
                if alive[o]:
                    if o in nb:
                        drop(o, pols[o].peer_dead(names[h]))
                        poll.add(o)
                    else:
                        pols[o].member_dead(names[h])
            for key in list(queues[h]):
                if key in live_req and alive[key[0]]:
                    live_req.discard(key)
            queues[h].clear()
        retry = set()
        while wakeups and wakeups[0][0] <= now:
            poll.add(heapq.heappop(wakeups)[1])
        for h in poll:
            if alive[h] and not pols[h].complete:
                issue(h, now)
        poll = retry

        down_used: dict[int, int] = {}
        rack_out = [rack_cap] * cfg.racks
        rack_in = [rack_cap] * cfg.racks
        completions = []

        def serve(q: deque, src_rack: int | None, credit: float) -> float:
            """Send from one uploader's queue while it has credit; skip hosts whose link is full."""
            skipped = []
            while q and credit >= 1.0:
                key = q.popleft()
                h = key[0]
                if key not in live_req or not alive[h]:
                    continue
                if down_used.get(h, 0) >= 1:
                    skipped.append(key)
                    continue
                hr = rack_of[h]
                if src_rack is not None and src_rack != hr:
                    if rack_out[src_rack] < 1.0 or rack_in[hr] < 1.0:
                        skipped.append(key)
                        continue
                    rack_out[src_rack] -= 1.0
                    rack_in[hr] -= 1.0
                down_used[h] = down_used.get(h, 0) + 1
                credit -= 1.0
                completions.append(key)
            q.extendleft(reversed(skipped))
            return credit

        origin_credit = serve(origin_q, None, min(origin_credit + origin_per_slot, max(1.0, origin_per_slot)))
        order = list(busy_uploaders)
        rnd.shuffle(order)
        busy_uploaders = set()
        for s in order:
            if alive[s]:
                serve(queues[s], rack_of[s], 1.0)
                if queues[s]:
                    busy_uploaders.add(s)
            else:
                busy_uploaders.add(s)   # requests wait until the death is noticed, as with a real timeout

        end = now + tau
        if debug is not None and slot % 50 == 0:
            idle = sum(1 for h in range(N) if alive[h] and not pols[h].complete and not pols[h].inflight)
            fetchable = sum(1 for h in range(N) if alive[h] and not pols[h].complete and not pols[h].inflight
                            and ((pols[h].avail > 0) & ~pols[h].have).any())
            have = np.array([pols[h].n_chunks - pols[h].missing for h in range(N)])
            lo = int(np.argmin(have))
            pl = pols[lo]
            debug.append((round(now, 1), len(completions), remaining, idle, fetchable, int(have.min()), int(np.median(have)), int(have.max()),
                          lo, len(pl.inflight), [(k, round(now - issued_at.get(k, now), 2)) for k in live_req if k[0] == lo][:4],
                          sum(1 for p in pl.peers.values() if not p.usable(now))))
        for key in completions:
            h, c, src = key
            live_req.discard(key)
            drop(h, pols[h].chunk_done(c, src, cfg.chunk, end - issued_at.pop(key, now), end))
            fresh[h].append(c)
            poll.add(h)
            transfers += 1
            if src == ORIGIN:
                origin_reads += 1
            elif rack_of[index[src]] != rack_of[h]:
                cross_rack += 1
            if pols[h].complete and np.isnan(done_at[h]):
                done_at[h] = end
                remaining -= 1
        slot += 1
        now = slot * tau
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

    surv = done_at[np.array(alive)]
    p50, p90, mx = (float(np.percentile(surv, q)) for q in (50, 90, 100))
    size_bytes = n_chunks * cfg.chunk
    out = {"config": asdict(cfg), "chunks": n_chunks, "survivors": int(sum(alive)), "died": N - int(sum(alive)),
           **analytic_baselines(N, cfg.size, cfg.rate, origin_rate),
           "p50_s": p50, "p90_s": p90, "max_s": mx, "ratio": mx / lower,
           "origin_copies": origin_reads * cfg.chunk / size_bytes,
           "cross_rack_copies_per_chunk": cross_rack / n_chunks,
           "cross_rack_bytes": cross_rack * cfg.chunk,
           "transfers": transfers, "wall_s": time.monotonic() - wall0}
    out["naive_over_swarm"] = out["naive_pull_s"] / mx
    out["tree_over_swarm"] = out["binary_tree_s"] / mx
    return out
