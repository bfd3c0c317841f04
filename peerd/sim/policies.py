"""The real ``SwarmPolicy`` objects, one per host, driven over the simulator's links (small fleets).

This is the check on the batched simulator (``peerd/sim/fleet.py``): the same topology, seeders,
deaths and fluid network, but every decision is made by the daemon's own policy object fed the
events peerd feeds it: bitmap pushes every ``have_interval`` (``peer_has``), a dead host's peers
giving up on it after ``dead_after`` (``peer_dead`` / ``member_dead``), busy and failed requests
(``chunk_failed``), finished transfers with their measured time (``chunk_done``, whose cancels end
endgame duplicates) and a ``tick`` every second. Time advances in the same steps as the simulator's.
"""
from __future__ import annotations

import collections
import random
import time

import numpy as np

from peerd.policy import ORIGIN, Cancel, SwarmPolicy
from peerd.sim.config import SimConfig
from peerd.sim.fluid import rates_with_priority
from peerd.sim.topology import build


class _Flows(dict):
    """(dst, src, chunk) -> [chunks left, start time]; src ORG is the origin. Counts each source's
    flows as they come and go: a busy check per request would otherwise scan every flow."""

    def __init__(self):
        super().__init__()
        self.by_source: collections.Counter[int] = collections.Counter()

    def __setitem__(self, key, value):
        if key not in self:
            self.by_source[key[1]] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        super().__delitem__(key)
        self.by_source[key[1]] -= 1

    def pop(self, key, *default):
        if key in self:
            self.by_source[key[1]] -= 1
        return super().pop(key, *default)


class PolicyFleet:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.N, self.C = N, C = cfg.hosts, cfg.chunks
        self.ORG = N
        topo = build(cfg, random.Random(cfg.seed))
        self.rack, self.nbr, self.deaths = topo.rack, topo.neighbours, list(topo.deaths)
        seeders = tuple(str(s) for s in topo.seeders)
        self.pol = [SwarmPolicy(me=str(h), n_chunks=C, rack=str(self.rack[h]), config=cfg.policy,
                                seed=cfg.seed * 100_003 + h, seeders=seeders,
                                rack_members=tuple(str(m) for m in topo.by_rack[int(self.rack[h])]))
                    for h in range(N)]
        self.peers_of = [[int(g) for g in self.nbr[h] if g < N] for h in range(N)]
        for h in range(N):
            for g in self.peers_of[h]:
                self.pol[h].peer_bitmap(str(g), np.zeros(C, bool), 0.0, rack=str(self.rack[g]))
        self.alive = np.ones(N, bool)
        self.done_at = np.full(N, np.nan)
        self.fresh: list[list[int]] = [[] for _ in range(N)]   # finished since the last bitmap push
        self.flows = _Flows()
        self.carry = np.zeros(N)
        self.detect: list[tuple[float, int]] = []
        self.stalls: list[tuple[float, int]] = []
        self.origin_reads = 0
        self.rng = np.random.default_rng(cfg.seed)

    def _name(self, src: int) -> str:
        return ORIGIN if src == self.ORG else str(src)

    def _src(self, name: str) -> int:
        return self.ORG if name == ORIGIN else int(name)

    def _uploads(self, s: int) -> int:
        return self.flows.by_source[s]

    def _cancel(self, dst: int, cancels: list[Cancel]) -> None:
        for x in cancels:
            self.flows.pop((dst, self._src(x.source), x.chunk), None)

    def run(self) -> dict:
        wall0 = time.monotonic()
        cfg = self.cfg
        dt = cfg.chunk / cfg.rate / cfg.steps_per_chunk
        lower = cfg.lower_bound_s
        next_have, next_tick, step = cfg.have_interval, 1.0, 0
        while np.isnan(self.done_at[self.alive]).any():
            now = step * dt
            self._failures(now)
            self._requests(now)
            self.carry[:] = 0
            self._transfer(now, dt)
            step += 1
            now = step * dt
            if now >= next_have:
                next_have += cfg.have_interval
                self._push_bitmaps(now)
            if now >= next_tick:
                next_tick += 1.0
                for h in np.flatnonzero(self.alive):
                    self.pol[h].tick(now)
            if now > 20 * lower:
                raise RuntimeError("policy fleet did not converge")
        surv = self.done_at[self.alive]
        mx, p50 = float(surv.max()), float(np.percentile(surv, 50))
        return {"ratio": mx / lower, "p50_ratio": p50 / lower, "max_s": mx, "survivors": int(self.alive.sum()),
                "origin_copies": self.origin_reads / self.C, "wall_s": time.monotonic() - wall0}

    def _failures(self, now: float) -> None:
        while self.deaths and self.deaths[0][0] <= now:
            _, h = self.deaths.pop(0)
            self._push_bitmaps(now, only=h)            # what it finished went out before it died
            self.alive[h] = False
            for key in [k for k in self.flows if k[0] == h]:
                del self.flows[key]
            self.detect.append((now + self.cfg.dead_after, h))
            self.stalls.append((now + self.cfg.stall_after, h))
        while self.stalls and self.stalls[0][0] <= now:     # downloads from it receive nothing: given up
            _, h = self.stalls.pop(0)
            for g, s, c in [k for k in self.flows if k[1] == h]:
                del self.flows[(g, s, c)]
                self._cancel(g, self.pol[g].chunk_failed(c, str(h), "error", now))
        while self.detect and self.detect[0][0] <= now:
            _, h = self.detect.pop(0)
            for g in np.flatnonzero(self.alive):
                if h in self.peers_of[g]:
                    self._cancel(int(g), self.pol[g].peer_dead(str(h)))
                else:
                    self.pol[g].member_dead(str(h))

    def _requests(self, now: float) -> None:
        """Hosts ask in a random order each round (peerd's hosts act on their own events, none of
        them systematically first); a host asked busy asks again in the next round."""
        hosts = np.flatnonzero(self.alive & np.isnan(self.done_at))
        for _ in range(self.cfg.request_rounds):
            self.rng.shuffle(hosts)
            asked = False
            for h in hosts:
                p = self.pol[h]
                reqs = p.next_requests(now)
                asked |= bool(reqs)
                for r in reqs:
                    s = self._src(r.source)
                    if s != self.ORG and not self.alive[s]:
                        self._cancel(h, p.chunk_failed(r.chunk, r.source, "error", now))
                    elif s != self.ORG and self._uploads(s) >= self.cfg.max_uploads:
                        self._cancel(h, p.chunk_failed(r.chunk, r.source, "busy", now))
                    else:
                        left = 1.0 if s == self.ORG else 1.0 - self.carry[h]
                        self.carry[h] = 0
                        self.flows[(int(h), s, r.chunk)] = [left, now]
            if not asked:
                break

    def _transfer(self, now: float, dt: float) -> None:
        if not self.flows:
            return
        keys = list(self.flows)
        dst = np.array([k[0] for k in keys])
        src = np.array([k[1] for k in keys])
        up_cap = np.append(np.where(self.alive, 1.0, 0.0), (self.cfg.origin_rate or self.cfg.rate) / self.cfg.rate)
        moved = rates_with_priority(src, dst, up_cap, np.ones(self.N), src == self.ORG) / self.cfg.steps_per_chunk
        for key, m in zip(keys, moved):
            f = self.flows.get(key)
            if f is None:                              # cancelled by an earlier completion this step
                continue
            f[0] -= m
            if f[0] > 1e-9:
                continue
            h, s, c = key
            over = -f[0]
            t_end = now + dt * (1 - over / max(m, 1e-12))
            del self.flows[key]
            if s != self.ORG:
                self.carry[h] += min(over, m)
            else:
                self.origin_reads += 1
            p = self.pol[h]
            new = not p.have[c]
            self._cancel(h, p.chunk_done(c, self._name(s), self.cfg.chunk, t_end - f[1], t_end))
            if new:
                self.fresh[h].append(c)
                if p.complete:
                    self.done_at[h] = t_end

    def _push_bitmaps(self, now: float, only: int | None = None) -> None:
        """Every host pushes what it finished since the last push, and its upload load, to its peers."""
        uploads = np.bincount([s for (_, s, _) in self.flows if s != self.ORG], minlength=self.N)
        for h in ([only] if only is not None else range(self.N)):
            if not self.alive[h]:
                continue
            chunks, self.fresh[h] = self.fresh[h], []
            load = uploads[h] / self.cfg.max_uploads
            for g in self.peers_of[h]:
                if self.alive[g]:
                    self.pol[g].peer_has(str(h), chunks, now, load=load)


def simulate_policies(cfg: SimConfig) -> dict:
    return PolicyFleet(cfg).run()
