"""Who a simulated host talks to: racks, the neighbour graph and the seeders (same for both drivers)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from peerd.seeders import seeders_across_racks
from peerd.sim.config import SimConfig


@dataclass
class Topology:
    rack: np.ndarray            # (hosts,) rack index of each host
    by_rack: dict[int, list[int]]
    neighbours: np.ndarray      # (hosts, width) neighbour ids, padded with ``hosts`` (nobody)
    seeders: np.ndarray         # sorted host ids that may read the origin
    deaths: list[tuple[float, int]]   # (time, host), sorted


def build(cfg: SimConfig, rnd: random.Random) -> Topology:
    n = cfg.hosts
    rack = np.array([h % cfg.racks for h in range(n)])
    by_rack: dict[int, list[int]] = {}
    for h in range(n):
        by_rack.setdefault(int(rack[h]), []).append(h)
    nbrs = _neighbour_graph(cfg, rnd, by_rack)
    # as a rollout names them: round-robin over the racks
    seeders = np.array(sorted(int(h) for h in seeders_across_racks(((str(h), str(rack[h])) for h in range(n)), cfg.seeders)))
    deaths = sorted((rnd.uniform(0.1, 0.9) * cfg.lower_bound_s, h)
                    for h in rnd.sample(range(n), int(cfg.fail_fraction * n)))
    return Topology(rack, by_rack, nbrs, seeders, deaths)


def _neighbour_graph(cfg: SimConfig, rnd: random.Random, by_rack: dict[int, list[int]]) -> np.ndarray:
    """A near-regular random graph: every host has about ``max_active_peers`` peers,
    ``max_cross_rack_peers`` of them in other racks (peerd's rack-aware peer set)."""
    n, k = cfg.hosts, min(cfg.max_active_peers, cfg.hosts - 1)
    nbrs: list[set[int]] = [set() for _ in range(n)]

    def pair(stubs: list[int]) -> None:
        rnd.shuffle(stubs)
        for a, b in zip(stubs[::2], stubs[1::2]):
            if a != b:
                nbrs[a].add(b)
                nbrs[b].add(a)

    remote = min(cfg.policy.max_cross_rack_peers, k)
    local = k - remote if cfg.racks > 1 else k
    for members in by_rack.values():
        pair([h for h in members for _ in range(min(local, len(members) - 1))])
    pair([h for h in range(n) for _ in range(k - local)])
    for h in range(n):            # top up hosts that lost edges to self-pairs and duplicates
        while len(nbrs[h]) < k:
            o = rnd.randrange(n)
            if o != h:
                nbrs[h].add(o)
                nbrs[o].add(h)
    width = max(len(x) for x in nbrs)
    out = np.full((n, width), n, np.int64)
    for h, x in enumerate(nbrs):
        out[h, :len(x)] = sorted(x)
    return out
