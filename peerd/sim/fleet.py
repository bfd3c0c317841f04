"""Flow-level swarm simulator at fleet scale (10,000 hosts x 6,250 chunks).

Every host runs peerd's decision rules, in compiled per-host loops (``peerd/sim/kernels.py``) built
from the functions in ``peerd/choice.py`` that ``SwarmPolicy`` calls: rarest first (by the count
of neighbours known to hold a chunk) inside a window of the lowest missing chunks with a per-host
random tie-break; sources in the host's own rack first; across racks only for the host's import
stripe, its backup stripe after ``rack_grace_s``, widening after ``rack_rescue_s``; origin reads
striped over the seeders believed alive, only for chunks no neighbour is known to hold.

A host knows only what peerd would know. Holdings arrive by bitmap pushes every ``have_interval``
(a chunk finished since the last push cannot be asked for); a dead host is believed alive until
``dead_after`` has passed, so requests to it fail (back-off ``backoff_s``) and its origin stripe waits
for its re-division; an uploader at ``max_uploads`` answers busy (back-off ``busy_backoff_s``). What
stands in for peerd's throughput tracking is the uploader's load (fewer flows, faster each).

The network is a fluid model (``peerd/sim/fluid.py``): each request is a flow; every time step flows
get a max-min fair share of the uploader's and the downloader's link and, across racks, of both
racks' uplinks. A dead host's in-flight uploads stall until each downloader gives them up
(``stall_after``) and back off; its peers call it dead after ``dead_after``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict

import numpy as np

from peerd.choice import cross_rack_ok, import_reach, origin_order, origin_owner, peer_budget, tiebreak_params
from peerd.sim import kernels
from peerd.sim.allocator import keep_freed_memory
from peerd.sim.config import SimConfig, analytic_baselines
from peerd.sim.fluid import scale_to_caps
from peerd.sim.topology import build


class _Flows:
    """In-flight requests in per-host slots: ``src[h, k]`` (-1 free), chunk, bytes left (in chunks),
    and the source's position in the host's neighbour list."""

    def __init__(self, n: int, slots: int):
        self.src = np.full((n, slots), -1, np.int32)
        self.chunk = np.zeros((n, slots), np.int32)
        self.left = np.zeros((n, slots))
        self.nk = np.zeros((n, slots), np.int8)


class FleetSim:
    """The whole fleet's state as arrays, one method per phase of a time step."""

    def __init__(self, cfg: SimConfig):
        self.cfg, pol = cfg, cfg.policy
        self.rnd = random.Random(cfg.seed)
        self.nrng = np.random.default_rng(cfg.seed)
        self.C = C = cfg.chunks
        self.N = N = cfg.hosts
        self.W = W = min(pol.window, C)
        self.D = pol.max_inflight + pol.seeder_inflight   # peer download slots; slot D is the origin read
        self.ORG = N + 1                                # source index of the origin; N is "nobody"
        self.dt = cfg.chunk / cfg.rate / cfg.steps_per_chunk
        self.lower = cfg.lower_bound_s
        topo = build(cfg, self.rnd)
        self.rack = np.concatenate([topo.rack, [-1, -2]])
        self.by_rack = {r: np.array(m) for r, m in topo.by_rack.items()}
        self.nbr = topo.neighbours.astype(np.int32)   # (narrow: the rounds' rows stay in cache)
        self.same_rack = self.rack[self.nbr] == self.rack[:N, None]
        self.seeders = topo.seeders
        self.deaths = topo.deaths
        self.tb_a, self.tb_b = tiebreak_params(self.nrng, N)

        self.have = np.zeros((N + 1, C + W), bool)     # what each host holds
        self.have[:, C:] = True                        # padding: the window never runs off the end
        # what each host has announced (its peers' view): one bit per (chunk, host), rack-mates side by side
        self.slot, words = kernels.bit_slots(topo.rack, cfg.racks)
        self.known = np.zeros((C + W, words), np.uint64)
        self.known[C:] = np.uint64(2**64 - 1)
        self.shown = np.zeros((N + 1, -(-(C + W) // 64)), np.uint64)   # the same, host by host (kernels._shows)
        pad = np.arange(C, C + W)
        np.bitwise_or.at(self.shown[N], pad >> 6, np.uint64(1) << (pad & 63).astype(np.uint64))
        self.shown[:N] = self.shown[N]
        self.nbr_slot = self.slot[self.nbr].astype(np.int32)   # each neighbour's bit
        self.pend = np.zeros((N, C + W), bool)         # what it has asked for
        self.nb_cnt = np.zeros((N, C + W), np.uint8)   # neighbours believed alive known to hold each chunk
        self.nb_far = np.zeros((N, C + W), np.uint8)   # ... of them in other racks
        self.seen = np.full(C + W, np.inf)             # first announcement of each chunk, fleet-wide
        self.lo = np.zeros(N, np.int64)
        self.count = np.zeros(N, np.int64)
        self.alive = np.ones(N + 2, bool)
        self.alive[N] = False
        self.believed_dead = ~self.alive.copy()        # after dead_after: what every peer believes
        self.done_at = np.full(N, np.nan)
        self.rack_rank = np.zeros(N, np.int64)         # position among the rack's live members
        self.rack_size = np.ones(N, np.int64)
        for r in self.by_rack:
            self._restripe(r)
        self._deal_stripes()

        self.fl = _Flows(N, self.D + 1)                # slot D is the host's origin read
        self.n_up = np.zeros(N + 2, np.int64)
        self.load = np.zeros(N + 2)                    # upload load each host last reported
        self.n_down = np.zeros(N, np.int64)            # peer downloads
        seeding = np.zeros(N, bool)                    # ... at most (choice.peer_budget)
        seeding[self.seeders] = True
        seeds_in = {r: int(seeding[m].sum()) for r, m in self.by_rack.items()}
        self.budget = np.array([peer_budget(pol.max_inflight, pol.seeder_inflight, seeding[h], seeds_in[self.rack[h]],
                                            len(self.by_rack[self.rack[h]])) for h in range(N)])
        self.per_peer = np.zeros(self.nbr.shape, np.int16)   # my requests in flight to each neighbour
        self.backoff = np.zeros(self.nbr.shape)        # until when a neighbour is not asked
        self.ready = np.zeros(self.nbr.shape, np.int8)   # the neighbours a host may ask this step
        self.n_ready = np.full(N, -1)                  # (kernels._ready_peers; -1: not looked at yet)
        self.asked = np.full(N, -1)                    # the neighbour each host asked since (kernels.ask)
        self.K = K = min(pol.plan_size, cfg.plan_rows, W)
        self.plan = np.zeros((N, K), np.int32)         # each host's ranked chunks, and how far it got
        self.plan_ok = np.zeros((N, K), bool)
        self.plan_ptr = np.full(N, K)
        self.carry = np.zeros(N)                       # share left over by flows that ended mid-step
        self.up_cap = np.full(N + 2, 1.0)              # capacities in chunks per chunk-time
        self.up_cap[self.ORG] = (cfg.origin_rate or cfg.rate) / cfg.rate
        self.down_cap = np.ones(N)
        self.rack_caps = np.full(cfg.racks, (N / cfg.racks) / cfg.oversubscription)

        self.detect: list[tuple[float, int]] = []
        self.stalls: list[tuple[float, int]] = []
        self.announce: list[tuple[np.ndarray, np.ndarray]] = []
        self.imports = np.zeros((C, cfg.racks), np.int32)   # cross-rack copies into each rack
        self.origin_reads = self.transfers = 0
        self.remaining = N
        self.util_sum, self.util_steps, self.warm_s = 0.0, 0, math.nan
        self.origin_done = math.nan
        self.reached = np.zeros(C, bool)               # chunks some host holds
        self.step, self.next_have, self.announced = 0, cfg.have_interval, True
        self.front = 0                                 # 1 + the highest chunk id ever announced
        self.offered = np.zeros((N, 2 * W), np.int32)   # chunks a live neighbour is known to hold that the
        self.offered_n = np.zeros(N, np.int64)          # host lacked then (kernels.count_announced)
        self._reach_at: tuple = (math.nan, None)
        self.threads = 0                               # the parallel loops' threads (run() picks them)

    # ------------------------------------------------------------------ the run
    def run(self, progress=None) -> dict:
        wall0 = time.monotonic()
        self.threads = kernels.use_idle_cores()
        keep_freed_memory()
        next_progress = 0.0
        while self.remaining:
            now = self.advance()
            if progress and now >= next_progress:
                next_progress += self.lower / 100
                progress(now, self.lower, int(np.sum(~np.isnan(self.done_at))), self.N)
            if now > 20 * self.lower:
                raise RuntimeError(f"simulation did not converge by {20 * self.lower:.0f} s: "
                                   f"{self.remaining} hosts unfinished")
        return self._result(self.step, time.monotonic() - wall0)

    def advance(self) -> float:
        """One time step, every phase in order; returns the simulated time after it."""
        now = self.step * self.dt
        self._deaths(now)
        self._stalls(now)
        self._detections(now)
        self._read_origin(now)
        self._request(now, replan=self.announced)
        self.announced = False
        self.carry[:] = 0                              # a share not taken up by a new request is lost
        self._transfer(now)
        self.step += 1
        now = self.step * self.dt
        if now >= self.next_have:
            self.next_have += self.cfg.have_interval
            self._announce(now)
            self.announced = True
        return now

    # ------------------------------------------------------------------ failures
    def _deaths(self, now: float) -> None:
        fl = self.fl
        while self.deaths and self.deaths[0][0] <= now:
            _, h = self.deaths.pop(0)
            self._announce(now)                        # what it finished went out before it died
            self.alive[h] = False
            self.remaining -= 1
            ks = np.flatnonzero(fl.src[h] >= 0)
            self._end_flows(np.full(len(ks), h), ks)
            self.detect.append((now + self.cfg.dead_after, h))
            self.stalls.append((now + self.cfg.stall_after, h))

    def _stalls(self, now: float) -> None:
        """Downloads from a host that died receive nothing: after ``stall_after`` each downloader gives
        its request up and backs off that peer (peerd's read timeout), before anyone calls it dead."""
        fl = self.fl
        while self.stalls and self.stalls[0][0] <= now:
            _, h = self.stalls.pop(0)
            hs, ks = np.nonzero(fl.src[:, :self.D] == h)
            self.pend[hs, fl.chunk[hs, ks]] = False
            self.backoff[hs, fl.nk[hs, ks]] = now + self.cfg.policy.backoff_s
            self._end_flows(hs, ks)

    def _detections(self, now: float) -> None:
        """Peers give up on a silent host: its holdings stop counting, its stalled uploads fail, and
        its rack's import stripes and the seeders' origin stripes are re-divided among the living."""
        fl, N, C = self.fl, self.N, self.C
        while self.detect and self.detect[0][0] <= now:
            _, h = self.detect.pop(0)
            self.believed_dead[h] = True
            rows = self.nbr[h][self.nbr[h] < N]
            held = self.knows(np.array([h]), np.arange(C))
            self.nb_cnt[rows, :C] -= held
            far = rows[self.rack[rows] != self.rack[h]]
            self.nb_far[far, :C] -= held
            self._relist(rows[self.alive[rows]])       # (a count back at zero leaves its list)
            hs, ks = np.nonzero(fl.src == h)
            self.pend[hs, fl.chunk[hs, ks]] = False
            self._end_flows(hs, ks)
            self._restripe(int(self.rack[h]))
            if h in self.seeders:
                self._deal_stripes()

    def _restripe(self, r: int) -> None:
        members = self.by_rack[r]
        live = members[~self.believed_dead[members]]
        self.rack_rank[live] = np.arange(len(live))
        self.rack_size[members] = max(len(live), 1)

    # ------------------------------------------------------------------ decisions
    def _read_origin(self, now: float) -> None:
        """Each idle seeder reads the next chunk of its stripe that no neighbour is known to hold
        (SwarmPolicy._origin_chunks); a seeder believed dead has its stripe dealt to the living."""
        fl, D = self.fl, self.D
        for i in np.flatnonzero(self.alive[self.seeders] & (fl.src[self.seeders, D] < 0)):
            s = self.seeders[i]
            stripe = self.stripes[i]
            stripe = stripe[(self.nb_cnt[s, stripe] == 0) & ~self.have[s, stripe] & ~self.pend[s, stripe]]
            if len(stripe):
                c = int(origin_order(stripe, stripe, len(self.seeders), self.cfg.policy.origin_spread,
                                     self.tb_a, self.tb_b, s)[0])   # equal chunks: slot = index
                fl.src[s, D], fl.chunk[s, D], fl.left[s, D] = self.ORG, c, 1.0
                self.pend[s, c] = True
                self.n_up[self.ORG] += 1

    def _deal_stripes(self) -> None:
        owner = origin_owner(np.arange(self.C), ~self.believed_dead[self.seeders])
        self.stripes = [np.flatnonzero(owner == i) for i in range(len(self.seeders))]

    def _cross_ok(self, h: np.ndarray, c: np.ndarray, now: float) -> np.ndarray:
        """May host ``h`` pull chunk ``c`` from another rack (SwarmPolicy._cross_ok)?"""
        hh = h[:, None] if c.ndim == 2 else h
        n, pol = self.rack_size[hh], self.cfg.policy
        return cross_rack_ok((self.rack_rank[hh] - c) % n, n, now - self.seen[c], pol.rack_grace_s, pol.rack_rescue_s)

    def _reach(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """``choice.import_reach`` for every chunk now: the per-chunk half of the cross-rack rule
        (kept until the time or ``seen`` changes)."""
        if self._reach_at[0] != now:
            pol = self.cfg.policy
            self._reach_at = (now, import_reach(now - self.seen, pol.rack_grace_s, pol.rack_rescue_s))
        return self._reach_at[1]

    def _rank(self, rows: np.ndarray, width: int, now: float) -> None:
        """Re-plan these hosts: the rarest chunks of each one's window by usable holders."""
        kernels.rank_plans(rows, self.lo[rows], width, self.offered, self.offered_n, self.have, self.pend,
                           self.nb_cnt, self.nb_far,
                           self.rack_rank, self.rack_size, *self._reach(now), self.tb_a, self.tb_b,
                           self.plan, self.plan_ok)
        self.plan_ptr[rows] = 0

    def _pick_source(self, h: np.ndarray, key: np.uint64, now: float) -> np.ndarray:
        """For each host, the ready neighbour it would ask now for whatever that neighbour offers
        (position; -1 where none is ready)."""
        k = np.empty(len(h), np.int64)
        kernels.pick_sources(h, key, self.nbr, self.known, self.nbr_slot, self.same_rack, self.believed_dead, self.backoff,
                             self.per_peer, self.load, now, self.cfg.policy.max_per_peer, self.ready, self.n_ready,
                             self.asked, k)
        return k

    def _ask(self, h: np.ndarray, c: np.ndarray, k: np.ndarray, now: float) -> None:
        """Host ``h[i]`` asks its neighbour ``k[i]`` for chunk ``c[i]`` (``kernels.ask``)."""
        fl, pol = self.fl, self.cfg.policy
        kernels.ask(h, c, k, now, self.nbr, self.alive, self.cfg.max_uploads, pol.backoff_s, pol.busy_backoff_s,
                    self.nrng.random(len(h)), self.n_up, self.backoff, fl.src, fl.chunk, fl.left, fl.nk, self.carry,
                    self.pend, self.n_down, self.per_peer, self.asked)

    def _request(self, now: float, replan: bool) -> None:
        N, W = self.N, self.W
        K = self.K
        hosts = np.flatnonzero(self.alive[:N] & np.isnan(self.done_at) & (self.n_down < self.budget))
        if len(hosts) == 0:
            return
        # only the columns below the announced front can hold anything a host may ask for (nobody
        # is known to hold the rest): the same ranking as over the whole window, on less of it
        w = int(np.clip((self.front - self.lo[hosts]).max(), 1, W))
        # rank afresh after bitmap pushes (the only time holder counts change) or when a list ran dry
        stale = hosts if replan else hosts[self.plan_ptr[hosts] >= K]
        if len(stale):
            self._rank(stale, w, now)
        self.n_ready[:] = -1                           # who is ready: looked at afresh each step
        walk = hosts
        for rnd in range(self.cfg.request_rounds):
            # asked, busy or no ready holder: each host is past this entry after the round
            h, c, k, tried = kernels.next_entries(walk, self._key(rnd), self.n_down, self.budget, self.plan,
                                                  self.plan_ok, self.plan_ptr, self.have, self.pend, self.nbr,
                                                  self.known, self.nbr_slot, self.same_rack, self.rack_rank,
                                                  self.rack_size, *self._reach(now),
                                                  self.believed_dead, self.backoff, self.per_peer, self.load, now,
                                                  self.cfg.policy.max_per_peer, self.ready, self.n_ready,
                                                  self.asked)
            if tried == 0:
                break
            if len(h):
                self._ask(h, c, k, now)
            walk = h        # the rest ran out of plan or of slots, and neither comes back this step
        # the rarest chunks' holders are all busy: ask an idle neighbour for the rarest chunk it
        # is known to have (SwarmPolicy._peer_first)
        for rnd in range(self.cfg.peer_first_rounds):
            h = hosts[self.n_down[hosts] < self.budget[hosts]]
            if len(h) == 0:
                break
            k = self._pick_source(h, self._key(self.cfg.request_rounds + rnd), now)
            h, k = h[k >= 0], k[k >= 0]
            if len(h) == 0:
                break
            cand = np.empty(len(h), np.int64)
            kernels.rarest_offered(h, self.nbr[h, k], ~self.same_rack[h, k], self.lo[h], W, self.offered,
                                   self.offered_n,
                                   self.have, self.pend,
                                   self.shown, self.nb_cnt, self.nb_far, self.rack_rank, self.rack_size,
                                   *self._reach(now), self.tb_a, self.tb_b, cand)
            ok = cand >= 0
            if not ok.any():
                break
            self._ask(h[ok], cand[ok], k[ok], now)

    def _key(self, rnd: int) -> np.uint64:
        """The random draws' key for round ``rnd`` of this step (``kernels.uniform``)."""
        return kernels.round_key(self.cfg.seed, self.step, rnd)

    # ------------------------------------------------------------------ the network
    def _transfer(self, now: float) -> None:
        """One fluid step: every flow moves its fair share; finished flows deliver their chunk."""
        fl, cfg, N, C = self.fl, self.cfg, self.N, self.C
        hs, ks, s, r = kernels.flow_rates(fl.src, self.alive, self.up_cap, self.down_cap, self.ORG)
        if len(hs) == 0:
            return
        if cfg.oversubscription > 1:
            cross = (self.rack[s] != self.rack[hs]) & (s < N)
            if cross.any():
                r[cross] = scale_to_caps(r[cross], [(self.rack[s[cross]], self.rack_caps),
                                                    (self.rack[hs[cross]], self.rack_caps)])
        moved, got, fin = kernels.move_flows(hs, ks, r, cfg.steps_per_chunk, fl.left, N)
        busy = np.isnan(self.done_at) & self.alive[:N]
        if busy.any():                                 # mean download utilisation of unfinished hosts
            u = float(got[busy].mean())
            self.util_sum, self.util_steps = self.util_sum + u, self.util_steps + 1
            if math.isnan(self.warm_s) and u >= 0.95:
                self.warm_s = now
        if not fin.any():
            return
        nh, nc, t_end, from_origin, finished = kernels.deliver(
            hs, ks, fin, moved, now, self.dt, self.D, N, C, self.ORG, self.rack, fl.src, fl.chunk, fl.left, fl.nk,
            self.n_up, self.n_down, self.per_peer, self.carry, self.have, self.pend, self.count, self.lo,
            self.reached, self.imports, self.done_at)
        if np.isnan(self.origin_done) and len(nh) and self.reached.all():
            self.origin_done = float(t_end.max())
        self.transfers += len(nh)
        self.origin_reads += from_origin
        self.remaining -= finished
        self.announce.append((nh, nc))

    def _announce(self, now: float) -> None:
        """Bitmap pushes: what hosts finished since the last push becomes known to their neighbours."""
        self.load[:self.N] = self.n_up[:self.N] / self.cfg.max_uploads
        if not self.announce:
            return
        h = np.concatenate([a for a, _ in self.announce])
        c = np.concatenate([b for _, b in self.announce])
        self.announce.clear()
        self.front = max(self.front, kernels.set_known(self.known, self.slot, self.shown, self.seen, h, c, now))
        self._reach_at = (math.nan, None)
        full = kernels.count_announced(h, c, self.nbr, self.same_rack, self.believed_dead, self.alive, self.have,
                                       self.N, self.nb_cnt, self.nb_far, self.offered, self.offered_n)
        if len(full):
            self._relist(full)

    # ------------------------------------------------------------------ bookkeeping
    def _relist(self, rows: np.ndarray) -> None:
        """Rebuild these hosts' offered lists from their counts, with room for twice as many where one
        is short of it (a host far behind)."""
        while not kernels.list_offered(rows, self.nb_cnt, self.have, self.C, self.offered, self.offered_n):
            need = int(((self.nb_cnt[rows, :self.C] > 0) & ~self.have[rows, :self.C]).sum(axis=1).max())
            grown = np.zeros((self.N, 2 * need), self.offered.dtype)
            grown[:, :self.offered.shape[1]] = self.offered
            self.offered = grown

    def knows(self, hosts: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """Is ``hosts`` known to hold ``chunks`` (broadcast together)?"""
        h, c = np.broadcast_arrays(hosts, chunks)
        return kernels.knows(self.known, self.slot, h.ravel(), c.ravel()).reshape(h.shape)

    def _end_flows(self, hs: np.ndarray, ks: np.ndarray) -> None:
        fl = self.fl
        kernels.end_flows(hs, ks, self.D, fl.src, fl.nk, self.n_up, self.n_down, self.per_peer)

    def _result(self, steps: int, wall_s: float) -> dict:
        cfg, N, C = self.cfg, self.N, self.C
        surv = self.done_at[self.alive[:N]]
        p50, p90, mx = (float(np.percentile(surv, q)) for q in (50, 90, 100))
        imports = self.imports[:, np.unique(self.rack[:N])]
        out = {"config": asdict(cfg), "chunks": C, "survivors": int(self.alive[:N].sum()),
               "died": N - int(self.alive[:N].sum()),
               **analytic_baselines(N, cfg.size, cfg.rate, cfg.origin_rate or cfg.rate),
               "origin_done_s": self.origin_done, "p50_s": p50, "p90_s": p90, "max_s": mx,
               "ratio": mx / self.lower, "p50_ratio": p50 / self.lower,
               "origin_copies": self.origin_reads / C,
               "cross_rack_copies_per_chunk": float(imports.sum() / C),
               "copies_per_chunk_per_rack": {"mean": float(imports.mean()), "p99": float(np.percentile(imports, 99)),
                                             "max": int(imports.max())},
               "cross_rack_bytes": int(imports.sum()) * cfg.chunk,
               "mean_download_utilisation": self.util_sum / max(self.util_steps, 1),
               "warm_up_s": self.warm_s,               # until unfinished hosts first download at >= 95 %
               "transfers": self.transfers, "steps": steps, "wall_s": wall_s, "threads": self.threads}
        out["naive_over_swarm"] = out["naive_pull_s"] / mx
        out["tree_over_swarm"] = out["binary_tree_s"] / mx
        return out


def simulate(cfg: SimConfig, progress=None) -> dict:
    return FleetSim(cfg).run(progress)
