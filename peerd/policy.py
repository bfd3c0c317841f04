"""The swarm policy: a pure, deterministic state machine (sans-I/O).

It owns every *decision* of a downloading host (which chunk next, from which peer, when to give up
on a peer, endgame, when the origin may be read) and none of the I/O. The daemon and the simulator
feed it the same events and carry out the same actions, so what the simulator measures is what the
daemon does. It has no clock (``now`` comes with each event) and its randomness is seeded.

Events: ``peer_bitmap``, ``peer_has``, ``peer_dead``, ``member_dead``, ``chunk_done``,
``chunk_failed``, ``tick``. Actions: ``next_requests`` returns ``Request``s; events may return
``Cancel``s (endgame duplicates, a dead peer's requests).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from peerd.choice import (cross_rack_ok, origin_order, origin_owner, peer_budget, rank_window, rarest_offered,
                          rarity_key, source_scores, tiebreak_params)

ORIGIN = "<origin>"


@dataclass(frozen=True)
class PolicyConfig:
    max_inflight: int = 8          # requests in flight per host
    seeder_inflight: int = 2       # more for a seeder where seeders are under half its rack (choice.peer_budget)
    max_per_peer: int = 2          # requests in flight to any one peer
    origin_inflight: int = 1       # concurrent origin reads per host (one at a time: the first chunk lands soonest)
    origin_catch_up: int = 4       # ... up to this many while its stripe holds more than its share of what nobody has
    peer_catch_up: int = 4         # more peer requests in flight while this host is behind its peers (see _catch_up)
    origin_spread: int = 4         # origin reads go block by block, this many stripe positions a block
    random_first: int = 2          # first chunks picked at random (something to trade early)
    endgame_chunks: int = 4        # duplicate requests once this few chunks are missing
    endgame_dups: int = 2          # sources per chunk in endgame
    slow_factor: float = 0.25      # evict a peer below this fraction of the median throughput
    min_samples: int = 3           # transfers before a peer's throughput is judged
    backoff_s: float = 2.0         # first back-off for a slow or failing peer; doubles
    max_backoff_s: float = 30.0
    busy_backoff_s: float = 0.05   # a peer at its upload limit is retried soon
    origin_missing_backoff_s: float = 0.25   # the origin lacks the file: a publish still uploading it, retried soon
    max_errors: int = 3            # consecutive errors before a peer is declared dead
    rack_grace_s: float = 2.0      # a chunk's backup importer in each rack waits this long before pulling cross-rack
    rack_rescue_s: float = 10.0    # after this 2, 4, 8... rack members may pull it across racks, doubling every rack_grace_s
    max_cross_rack_peers: int = 12  # peers in other racks tracked at once (rack-local imports keep uplinks at ~2 copies a chunk)
    plan_size: int = 64            # chunks ranked per re-plan
    replan_s: float = 0.1          # a plan older than this is ranked again (cross-rack permissions open with time)
    window: int = 1024             # ranked among the lowest missing chunks: a bounded spread of
                                   # half-done work, and the same rule the simulator runs at scale


@dataclass(frozen=True)
class Request:
    chunk: int
    source: str


@dataclass(frozen=True)
class Cancel:
    chunk: int
    source: str


@dataclass
class PeerState:
    rack: str
    bits: np.ndarray
    alive: bool = True
    quarantined: bool = False
    inflight: int = 0
    errors: int = 0
    backoff_until: float = 0.0
    backoff_s: float = 0.0
    rate: float = 0.0              # EWMA bytes/s over completed transfers
    samples: int = 0
    load: float = 0.0              # share of its upload slots in use, as it last reported
    held: int = 0                  # chunks it holds, as known here

    def usable(self, now: float) -> bool:
        return self.alive and not self.quarantined and now >= self.backoff_until

    def open(self, now: float) -> bool:
        """Worth a new request: usable and not full when it last reported (it would answer busy)."""
        return self.usable(now) and self.load < 1.0


@dataclass
class SwarmPolicy:
    me: str
    n_chunks: int
    rack: str = ""
    have: np.ndarray | None = None
    config: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    seeders: tuple[str, ...] = ()       # hosts that may read the origin, striped
    rack_members: tuple[str, ...] = ()  # hosts of my rack, for cross-rack import striping
    origin_slots: np.ndarray | None = None   # choice.origin_slots of the chunk sizes (None: equal chunks)

    def __post_init__(self):
        n = self.n_chunks
        self.rng = np.random.default_rng(self.seed)
        self.origin_slots = np.arange(n) if self.origin_slots is None else np.asarray(self.origin_slots, np.int64)
        self._rnd = random.Random(self.seed)       # cheap scalar draws for peer tie-breaks
        self._peer_list: list[tuple[str, PeerState]] = []
        self.have = np.zeros(n, bool) if self.have is None else np.asarray(self.have, bool).copy()
        self.avail = np.zeros(n, np.int32)          # live usable holders among known peers
        self.avail_far = np.zeros(n, np.int32)      # ... of them in other racks
        self.inflight_mask = np.zeros(n, bool)
        self.inflight: dict[int, set[str]] = {}
        self.peers: dict[str, PeerState] = {}
        self.dead_members: set[str] = set()
        self.first_seen = np.full(n, math.inf)
        self._tb = tiebreak_params(self.rng, 1)
        self.lo = int(np.argmin(self.have)) if not self.have.all() else n   # lowest missing chunk
        self.origin_reads = 0
        self.origin_active = 0
        self.peer_requests = 0
        self.origin_backoff_until = 0.0
        # a chunk whose file the origin does not have yet (a publish still uploading it) waits alone: the
        # seeder reads the rest of its stripe meanwhile (a stable order would put that chunk first again)
        self.origin_missing_until = np.zeros(n)
        self._plan = np.zeros(0, np.int64)
        self._dirty, self._planned_at = True, -math.inf
        self.missing = int(n - self.have.sum())
        rack = set(self.rack_members) | {self.me}
        self.peer_budget = peer_budget(self.config.max_inflight, self.config.seeder_inflight, self.me in self.seeders,
                                       len(rack & set(self.seeders)), len(rack))
        self._restripe()

    # ------------------------------------------------------------ membership and striping
    def _live(self, members) -> list[str]:
        return sorted(m for m in members if m == self.me or m not in self.dead_members)

    def _restripe(self) -> None:
        idx = np.arange(self.n_chunks)
        seeds = sorted(self.seeders)
        live = np.array([s == self.me or s not in self.dead_members for s in seeds], bool)
        self.origin_mask = (origin_owner(self.origin_slots, live) == seeds.index(self.me)) if self.me in seeds \
            else np.zeros(self.n_chunks, bool)
        self._origin_any = bool(self.origin_mask.any())   # most hosts own no stripe: skip the scan per request
        racks = self._live(self.rack_members)
        if self.me in racks and len(racks) > 1:
            self.rack_n = len(racks)
            self.rack_dist = (racks.index(self.me) - idx) % self.rack_n   # 0: the chunk's importer here
        else:
            self.rack_n, self.rack_dist = 1, np.zeros(self.n_chunks, np.int64)   # no rack: always allowed
        self._dirty = True

    # ------------------------------------------------------------ events
    def peer_bitmap(self, peer: str, bits, now: float, rack: str | None = None, load: float | None = None) -> bool:
        """A peer's full bitmap (gossip), with the share of its upload slots in use. Adds or revives
        the peer; returns False for a new peer in another rack while ``max_cross_rack_peers`` live
        ones are tracked already (rack-aware peer set: with few remote peers, most bytes stay inside
        the rack)."""
        bits = np.asarray(bits, bool)
        p = self.peers.get(peer)
        if p is None and self._remote(rack) and sum(
                1 for q in self.peers.values()
                if self._remote(q.rack) and q.alive and not q.quarantined) >= self.config.max_cross_rack_peers:
            return False
        if p is None:
            p = self.peers[peer] = PeerState(rack=rack if rack is not None else "", bits=np.zeros(self.n_chunks, bool))
            self._peer_list.append((peer, p))
            p.alive = False  # counted in below
        if rack is not None and rack != p.rack:
            counted = p.alive and not p.quarantined   # its holdings move between the rack counts
            if counted:
                self._count(p, -p.bits.astype(np.int32))
            p.rack = rack
            if counted:
                self._count(p, p.bits.astype(np.int32))
        if load is not None:
            p.load = load
        if peer in self.dead_members:
            self.dead_members.discard(peer)
            self._restripe()
        if not p.alive and not p.quarantined:
            p.alive, p.errors = True, 0
            self._count(p, p.bits.astype(np.int32))
        if p.alive and not p.quarantined:
            gained = bits & ~p.bits
            self._count(p, bits.astype(np.int32) - p.bits.astype(np.int32))
            self._note_seen(gained, now)
        p.bits = bits.copy()
        p.held = int(p.bits.sum())
        self._dirty = True
        return True

    def _count(self, p: PeerState, delta, where=slice(None)) -> None:
        self.avail[where] += delta
        if self._remote(p.rack):
            self.avail_far[where] += delta

    def _usable(self, cols: np.ndarray, now: float, cross_ok: np.ndarray | None = None) -> np.ndarray:
        """Holders this host may ask, per chunk: its own rack's, and other racks' only where it may
        pull across (rarest first by what is rare *to this host*: a chunk that only other racks hold
        is not rare here unless this host is the one to import it)."""
        far = self.avail_far[cols]
        return self.avail[cols] - np.where(self._cross_ok(cols, now) if cross_ok is None else cross_ok, 0, far)

    def _remote(self, rack: str | None) -> bool:
        return bool(self.rack) and bool(rack) and rack != self.rack

    def peer_has(self, peer: str, chunks, now: float, load: float | None = None) -> None:
        """Incremental announcement of chunks a known peer now holds (and its upload load)."""
        p = self.peers.get(peer)
        if p is None:
            return
        if load is not None:
            p.load = load
        chunks = np.asarray(chunks, np.int64)
        new = chunks[~p.bits[chunks]]
        p.bits[new] = True
        p.held += len(new)
        if p.alive and not p.quarantined and len(new):
            self._count(p, 1, new)
            self._note_seen(new, now)
            self._dirty = True

    def peer_dead(self, peer: str) -> list[Cancel]:
        """A peer stopped answering (missed gossip or repeated failures)."""
        self.member_dead(peer)
        p = self.peers.get(peer)
        if p is None or not p.alive:
            return []
        p.alive = False
        if not p.quarantined:
            self._count(p, -p.bits.astype(np.int32))
        return self._drop_requests_to(peer)

    def member_dead(self, member: str) -> None:
        if member == self.me or member in self.dead_members:
            return
        self.dead_members.add(member)
        if member in self.seeders or member in self.rack_members:
            self._restripe()

    def quarantine(self, peer: str) -> list[Cancel]:
        p = self.peers.get(peer)
        if p is None or p.quarantined:
            return []
        if p.alive:
            self._count(p, -p.bits.astype(np.int32))
        p.quarantined = True
        return self._drop_requests_to(peer)

    def chunk_done(self, chunk: int, source: str, nbytes: int, seconds: float, now: float) -> list[Cancel]:
        srcs = self.inflight.pop(chunk, set())
        self.inflight_mask[chunk] = False
        for s in srcs:
            self._release(s)
        if source != ORIGIN and source in self.peers:
            p = self.peers[source]
            p.errors, p.backoff_s = 0, 0.0
            r = nbytes / max(seconds, 1e-6)
            p.rate = r if p.samples == 0 else 0.7 * p.rate + 0.3 * r
            p.samples += 1
        if source == ORIGIN:
            self.origin_reads += 1
        if not self.have[chunk]:
            self.have[chunk] = True
            self.missing -= 1
            while self.lo < self.n_chunks and self.have[self.lo]:
                self.lo += 1
            self._dirty = True                       # the window may have slid
        return [Cancel(chunk, s) for s in srcs if s != source]

    def chunk_failed(self, chunk: int, source: str, reason: str, now: float) -> list[Cancel]:
        """reason: busy | missing | error | corrupt | cancelled."""
        srcs = self.inflight.get(chunk)
        if srcs and source in srcs:
            srcs.discard(source)
            self._release(source)
            if not srcs:
                del self.inflight[chunk]
                self.inflight_mask[chunk] = False
        self._dirty = True
        if source == ORIGIN:
            if reason == "missing":
                self.origin_missing_until[chunk] = now + self.config.origin_missing_backoff_s
            else:
                self.origin_backoff_until = now + self.config.backoff_s
            return []
        p = self.peers.get(source)
        if p is None:
            return []
        if reason == "corrupt":
            return self.quarantine(source)
        if reason == "missing" and p.bits[chunk]:
            p.bits[chunk] = False          # our view was stale
            if p.alive and not p.quarantined:
                self._count(p, -1, chunk)
        elif reason == "busy":
            p.backoff_until = max(p.backoff_until, now + self.config.busy_backoff_s)
        elif reason == "error":
            p.errors += 1
            if p.errors >= self.config.max_errors:
                return self.peer_dead(source)
            self._backoff(p, now)
        return []

    def tick(self, now: float) -> None:
        """Periodic housekeeping: evict peers far below the median throughput."""
        judged = [p for p in self.peers.values() if p.usable(now) and p.samples >= self.config.min_samples]
        if len(judged) < 3:
            return
        med = median(p.rate for p in judged)
        for p in judged:
            if p.rate < self.config.slow_factor * med:
                p.backoff_until = now + self.config.backoff_s
                p.samples = 0   # judged afresh after the back-off

    # ------------------------------------------------------------ decisions
    @property
    def complete(self) -> bool:
        return self.missing == 0

    def next_requests(self, now: float) -> list[Request]:
        if self.missing == 0:
            return []
        out: list[Request] = []
        # origin reads have their own budget: a seeder's peer pipeline never waits behind the origin
        for c in self._origin_chunks(now):
            self._add_request(c, ORIGIN)
            out.append(Request(c, ORIGIN))
        free = self.peer_budget + self._catch_up() - self.peer_requests
        if free <= 0:
            return out
        # peers that can take a request now, in a random rotation (random among equals)
        cap = self.config.max_per_peer
        ready = [(pid, p) for pid, p in self._peer_list if p.inflight < cap and p.open(now)]
        if not ready:
            return out
        r = self._rnd.randrange(len(ready))
        ready = ready[r:] + ready[:r]
        n_peer = 0
        for attempt in range(2):
            if self._dirty or attempt or now - self._planned_at >= self.config.replan_s:
                self._replan(now)
            plan = self._plan
            if len(plan):
                # only chunks a ready peer holds are worth a look
                ok = ~self.have[plan] & ~self.inflight_mask[plan]
                reach = np.zeros(len(plan), bool)
                local = [p.bits[plan] for _, p in ready if p.rack == self.rack]
                remote = [p.bits[plan] for _, p in ready if p.rack != self.rack]
                if local:
                    reach |= np.logical_or.reduce(local)
                far_ok = self._cross_ok(plan, now)
                if remote:   # across racks only where this host is the importer, or after the grace
                    reach |= np.logical_or.reduce(remote) & far_ok
                keep = ok & reach
                plan, far_ok = plan[keep], far_ok[keep]
            else:
                far_ok = np.zeros(0, bool)
            for c, far in zip(plan.tolist(), far_ok.tolist()):
                if self.inflight_mask[c]:
                    continue
                src = self._choose_source(c, ready, far)
                if src is None:
                    continue
                self._add_request(c, src)
                out.append(Request(c, src))
                n_peer += 1
                if self.peers[src].inflight >= cap:
                    ready = [x for x in ready if x[0] != src]
                if n_peer >= free or not ready:
                    return out
            if n_peer or len(self._plan) < self.config.plan_size:
                break  # nothing more is fetchable now, or the plan was complete
        if n_peer < free and ready:
            out += self._peer_first(now, free - n_peer, ready)
        if not out and self.missing <= self.config.endgame_chunks:
            out = self._endgame(now)
        return out

    def wake_at(self, now: float) -> float | None:
        """When a peer or the origin comes out of back-off: the driver should ask again then.

        None when nothing is backing off or every request slot is taken."""
        if self.peer_requests >= self.peer_budget or self.missing == 0:
            return None
        times = [p.backoff_until for p in self.peers.values()
                 if p.alive and not p.quarantined and p.backoff_until > now]
        if self.origin_backoff_until > now:
            times.append(self.origin_backoff_until)
        waiting = self.origin_missing_until[self.origin_missing_until > now]
        if waiting.size:
            times.append(float(waiting.min()))
        return min(times) if times else None

    def _replan(self, now: float) -> None:
        self._dirty, self._planned_at = False, now
        n = self.n_chunks
        cols = np.arange(self.lo, min(self.lo + self.config.window, n))[None, :]
        holders = self._usable(cols, now)
        if n - self.missing < self.config.random_first:
            holders = np.minimum(holders, 1)                # random order: something to trade early
        cand, ok = rank_window(~self.have[cols] & ~self.inflight_mask[cols], holders, np.array([self.lo]), *self._tb,
                               self.config.plan_size)
        self._plan = cand[0][ok[0]]

    def _cross_ok(self, chunks: np.ndarray, now: float) -> np.ndarray:
        """May these chunks come from another rack? Each chunk has one importer and one backup in
        every rack (stripes over the rack's live members), widening after ``rack_rescue_s``
        (``choice.cross_rack_ok``). The rest of the rack gets it from inside: about two copies of a
        chunk cross into a rack."""
        return cross_rack_ok(self.rack_dist[chunks], self.rack_n, now - self.first_seen[chunks],
                             self.config.rack_grace_s, self.config.rack_rescue_s)

    def _origin_chunks(self, now: float) -> list[int]:
        """The next chunks of this host's origin stripe that no live peer holds: near the front of
        the stripe (the fleet works through the file in order) but in random order among the first
        few, so that two seeders briefly disagreeing on who owns a stripe rarely read the same chunk."""
        if now < self.origin_backoff_until or not self._origin_any:
            return []
        unheld = (self.avail == 0) & ~self.have
        mine = self.origin_mask & unheld
        free = self._origin_budget(int(mine.sum()), int(unheld.sum())) - self.origin_active
        if free <= 0:
            return []
        cand = np.flatnonzero(mine & ~self.inflight_mask & (self.origin_missing_until <= now))
        return origin_order(cand, self.origin_slots[cand], len(self.seeders), self.config.origin_spread,
                            *self._tb, 0)[:free].tolist()

    def _catch_up(self) -> int:
        """Extra peer requests for a host that has fallen behind its peers (more than a full pipeline
        of chunks under their median). On kernel links a host's share of each uploader is TCP's, per
        flow: a host whose requests kept meeting the busiest uploaders fell ~20 % behind the others
        by the end of the origin's copy, then spent seconds alone at the tail. More flows in flight
        win it a larger share while it is behind."""
        extra = self.config.peer_catch_up
        if not extra:
            return 0
        held = sorted(p.held for p in self.peers.values() if p.alive and not p.quarantined)
        if not held:
            return 0
        mine = self.n_chunks - self.missing
        return extra if held[len(held) // 2] - mine > self.peer_budget else 0

    def _origin_budget(self, mine: int, unheld: int) -> int:
        """Origin reads to keep in flight. One while the fleet's origin work is spread evenly; more,
        up to ``origin_catch_up``, for a seeder whose stripe holds k times its share of the chunks no
        peer has (``mine`` of ``unheld``): at the end of the origin's copy the last stripes' owners
        would otherwise read one chunk at a time, each read sharing the owner's link with a full peer
        pipeline, while the origin's link idles."""
        live = sum(s == self.me or s not in self.dead_members for s in self.seeders)
        behind = mine * live // max(unheld, 1)
        return max(self.config.origin_inflight, min(behind, self.config.origin_catch_up))

    def _choose_source(self, c: int, ready: list, cross_ok: bool) -> str | None:
        same = np.array([p.rack == self.rack for _, p in ready])
        holds = np.array([bool(p.bits[c]) for _, p in ready]) & (same | cross_ok)
        if not holds.any():
            return None
        inflight = np.array([p.inflight for _, p in ready])
        score = source_scores(holds[None], same[None], inflight[None], self.rng, self._speed(ready)[None])[0]
        return ready[int(np.argmax(score))][0]

    @staticmethod
    def _speed(ready: list) -> np.ndarray:
        """How fast each peer should serve a new request, in [0, 1): mostly its spare upload slots
        as last reported (a loaded uploader splits its link more ways; every host acting on stale
        throughput alone herds onto the same fast peers), then its measured throughput rank."""
        rates = np.array([p.rate for _, p in ready])
        spare = 1.0 - np.array([min(p.load, 1.0) for _, p in ready])
        return 0.74 * spare + 0.25 * rates.argsort().argsort() / len(ready)

    def _peer_first(self, now: float, free: int, ready: list) -> list[Request]:
        """The rarest chunks' holders are all busy: rather than idle, ask each ready peer for the
        rarest chunk *it* has (BitTorrent's order: the uploader first, then rarest among its pieces)."""
        out: list[Request] = []
        cols = np.arange(self.lo, min(self.lo + self.config.window, self.n_chunks))[None, :]
        cross_ok = self._cross_ok(cols, now)
        holders = np.maximum(self._usable(cols, now, cross_ok), 1)
        # the window's rarity order is the same for every peer: only what each one offers differs
        key = rarity_key(holders, np.array([self.lo]), *self._tb)[0]
        want = ~self.have[cols[0]] & ~self.inflight_mask[cols[0]]
        for pid, p in sorted(ready, key=lambda x: x[1].load):   # the least loaded first (stable: random among equals)
            if len(out) >= free:
                break
            offered = p.bits[cols[0]] & want
            if p.rack != self.rack:
                offered &= cross_ok[0]
            i = rarest_offered(key, offered)
            if i >= 0:
                c = self.lo + i
                self._add_request(c, pid)
                want[i] = False
                out.append(Request(c, pid))
        return out

    def _endgame(self, now: float) -> list[Request]:
        out = []
        for c, srcs in list(self.inflight.items()):
            if len(srcs) >= self.config.endgame_dups:
                continue
            for pid, p in self.peers.items():
                if pid not in srcs and p.bits[c] and p.usable(now) and p.inflight < self.config.max_per_peer:
                    self._add_request(c, pid)
                    out.append(Request(c, pid))
                    break
        return out

    # ------------------------------------------------------------ bookkeeping
    def _add_request(self, c: int, src: str) -> None:
        self.inflight.setdefault(c, set()).add(src)
        self.inflight_mask[c] = True
        if src == ORIGIN:
            self.origin_active += 1
        else:
            self.peers[src].inflight += 1
            self.peer_requests += 1

    def _release(self, src: str) -> None:
        if src == ORIGIN:
            self.origin_active -= 1
        elif src in self.peers:
            self.peers[src].inflight -= 1
            self.peer_requests -= 1

    def _drop_requests_to(self, peer: str) -> list[Cancel]:
        out = []
        for c, srcs in list(self.inflight.items()):
            if peer in srcs:
                srcs.discard(peer)
                self._release(peer)
                out.append(Cancel(c, peer))
                if not srcs:
                    del self.inflight[c]
                    self.inflight_mask[c] = False
        self._dirty = True
        return out

    def _backoff(self, p: PeerState, now: float) -> None:
        p.backoff_s = min(self.config.max_backoff_s, p.backoff_s * 2 if p.backoff_s else self.config.backoff_s)
        p.backoff_until = now + p.backoff_s

    def _note_seen(self, gained: np.ndarray, now: float) -> None:
        self.first_seen[gained] = np.minimum(self.first_seen[gained], now)

    # ------------------------------------------------------------ introspection
    def peer_summary(self, now: float) -> list[dict]:
        return [{"peer": pid, "rack": p.rack, "alive": p.alive, "quarantined": p.quarantined,
                 "inflight": p.inflight, "rate_bps": round(p.rate), "backing_off": now < p.backoff_until,
                 "chunks": int(p.bits.sum()), "load": p.load} for pid, p in sorted(self.peers.items())]
