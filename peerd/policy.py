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

ORIGIN = "<origin>"


@dataclass(frozen=True)
class PolicyConfig:
    max_inflight: int = 8          # requests in flight per host
    max_per_peer: int = 2          # requests in flight to any one peer
    origin_inflight: int = 1       # concurrent origin reads per host (one at a time: the first chunk lands soonest)
    random_first: int = 2          # first chunks picked at random (something to trade early)
    endgame_chunks: int = 4        # duplicate requests once this few chunks are missing
    endgame_dups: int = 2          # sources per chunk in endgame
    slow_factor: float = 0.25      # evict a peer below this fraction of the median throughput
    min_samples: int = 3           # transfers before a peer's throughput is judged
    backoff_s: float = 2.0         # first back-off for a slow or failing peer; doubles
    max_backoff_s: float = 30.0
    busy_backoff_s: float = 0.05   # a peer at its upload limit is retried soon
    max_errors: int = 3            # consecutive errors before a peer is declared dead
    rack_grace_s: float = 2.0      # a non-designated host waits this long before pulling cross-rack
    plan_size: int = 64            # chunks ranked per re-plan


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

    def usable(self, now: float) -> bool:
        return self.alive and not self.quarantined and now >= self.backoff_until


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

    def __post_init__(self):
        n = self.n_chunks
        self.rng = np.random.default_rng(self.seed)
        self._rnd = random.Random(self.seed)       # cheap scalar draws for peer tie-breaks
        self._peer_list: list[tuple[str, PeerState]] = []
        self.have = np.zeros(n, bool) if self.have is None else np.asarray(self.have, bool).copy()
        self.avail = np.zeros(n, np.int32)          # live usable holders among known peers
        self.inflight_mask = np.zeros(n, bool)
        self.inflight: dict[int, set[str]] = {}
        self.peers: dict[str, PeerState] = {}
        self.dead_members: set[str] = set()
        self.first_seen = np.full(n, math.inf)
        self.tiebreak = self.rng.permutation(n).astype(np.int64)
        self.origin_reads = 0
        self.origin_active = 0
        self.peer_requests = 0
        self.origin_backoff_until = 0.0
        self._plan = np.zeros(0, np.int64)
        self._dirty = True
        self.missing = int(n - self.have.sum())
        self._restripe()

    # ------------------------------------------------------------ membership and striping
    def _live(self, members) -> list[str]:
        return sorted(m for m in members if m == self.me or m not in self.dead_members)

    def _restripe(self) -> None:
        idx = np.arange(self.n_chunks)
        live = self._live(self.seeders)
        self.origin_mask = (idx % len(live) == live.index(self.me)) if self.me in live else np.zeros(self.n_chunks, bool)
        racks = self._live(self.rack_members)
        if self.me in racks and len(racks) > 1:
            self.import_mask = (idx % len(racks)) == racks.index(self.me)
        else:
            self.import_mask = np.ones(self.n_chunks, bool)
        self._dirty = True

    # ------------------------------------------------------------ events
    def peer_bitmap(self, peer: str, bits, now: float, rack: str | None = None) -> None:
        """A peer's full bitmap (gossip). Adds or revives the peer."""
        bits = np.asarray(bits, bool)
        p = self.peers.get(peer)
        if p is None:
            p = self.peers[peer] = PeerState(rack=rack if rack is not None else "", bits=np.zeros(self.n_chunks, bool))
            self._peer_list.append((peer, p))
            p.alive = False  # counted in below
        if rack is not None:
            p.rack = rack
        if peer in self.dead_members:
            self.dead_members.discard(peer)
            self._restripe()
        if not p.alive and not p.quarantined:
            p.alive, p.errors = True, 0
            self.avail += p.bits
        if p.alive and not p.quarantined:
            gained = bits & ~p.bits
            self.avail += bits.astype(np.int32) - p.bits.astype(np.int32)
            self._note_seen(gained, now)
        p.bits = bits.copy()
        self._dirty = True

    def peer_has(self, peer: str, chunks, now: float) -> None:
        """Incremental announcement of chunks a known peer now holds."""
        p = self.peers.get(peer)
        if p is None:
            return
        chunks = np.asarray(chunks, np.int64)
        new = chunks[~p.bits[chunks]]
        p.bits[new] = True
        if p.alive and not p.quarantined and len(new):
            self.avail[new] += 1
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
            self.avail -= p.bits
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
            self.avail -= p.bits
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
                self.avail[chunk] -= 1
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
        # origin reads have their own budget: a seeder's peer pipeline never waits behind the origin
        free = self.config.max_inflight - self.peer_requests
        origin_ok = (self.origin_active < self.config.origin_inflight and now >= self.origin_backoff_until
                     and self.origin_mask.any())
        if (free <= 0 and not origin_ok) or self.missing == 0:
            return []
        # peers that can take a request now, in a random rotation (random among equals)
        cap = self.config.max_per_peer
        ready = [(pid, p) for pid, p in self._peer_list if p.inflight < cap and p.usable(now)]
        if ready:
            r = self._rnd.randrange(len(ready))
            ready = ready[r:] + ready[:r]
        if not ready and not origin_ok:
            return []
        n_peer = 0
        out: list[Request] = []
        for attempt in range(2):
            if self._dirty or attempt:
                self._replan(now)
            plan = self._plan
            if len(plan):
                # only chunks a ready peer holds, or that the origin may serve, are worth a look
                ok = ~self.have[plan] & ~self.inflight_mask[plan]
                reach = np.zeros(len(plan), bool)
                local = [p.bits[plan] for _, p in ready if p.rack == self.rack]
                remote = [p.bits[plan] for _, p in ready if p.rack != self.rack]
                if local:
                    reach |= np.logical_or.reduce(local)
                if remote:   # across racks only where this host is the importer, or after the grace
                    reach |= np.logical_or.reduce(remote) & (
                        self.import_mask[plan] | (now - self.first_seen[plan] >= self.config.rack_grace_s))
                if origin_ok:
                    reach |= self.origin_mask[plan] & (self.avail[plan] == 0)
                plan = plan[ok & reach]
            for c in plan.tolist():
                if self.inflight_mask[c]:
                    continue
                src = self._choose_source(c, now, ready if n_peer < free else [])
                if src is not None:
                    self._add_request(c, src)
                    out.append(Request(c, src))
                    if src != ORIGIN:
                        n_peer += 1
                        if self.peers[src].inflight >= cap:
                            ready = [x for x in ready if x[0] != src]
                    if (n_peer >= free or not ready) and not (
                            origin_ok and self.origin_active < self.config.origin_inflight):
                        return out
            if out or len(self._plan) < self.config.plan_size:
                break  # nothing more is fetchable now, or the plan was complete
        if n_peer == 0 and free > 0 and ready:
            out += self._peer_first(now, free, ready)
        if not out and self.missing <= self.config.endgame_chunks:
            out = self._endgame(now)
        return out

    def wake_at(self, now: float) -> float | None:
        """When a peer or the origin comes out of back-off: the driver should ask again then.

        None when nothing is backing off or every request slot is taken."""
        if self.peer_requests >= self.config.max_inflight or self.missing == 0:
            return None
        times = [p.backoff_until for p in self.peers.values()
                 if p.alive and not p.quarantined and p.backoff_until > now]
        if self.origin_backoff_until > now:
            times.append(self.origin_backoff_until)
        return min(times) if times else None

    def _replan(self, now: float) -> None:
        self._dirty = False
        want = ~self.have & ~self.inflight_mask
        fetchable = want & ((self.avail > 0) | self.origin_mask)
        cand = np.flatnonzero(fetchable)
        if len(cand) == 0:
            self._plan = cand
            return
        n_have = self.n_chunks - self.missing
        if n_have < self.config.random_first:
            key = self.tiebreak[cand]                       # random order: something to trade early
        else:
            key = self.avail[cand].astype(np.int64) * self.n_chunks + self.tiebreak[cand]  # rarest first
        k = self.config.plan_size
        if len(cand) > k:
            part = np.argpartition(key, k)[:k]
            cand, key = cand[part], key[part]
        self._plan = cand[np.argsort(key, kind="stable")]

    def _choose_source(self, c: int, now: float, ready: list) -> str | None:
        best_local = best_remote = None
        bl = br = None
        for pid, p in ready:
            if not p.bits[c]:
                continue
            if p.rack == self.rack:
                if bl is None or self._better(p, bl):
                    best_local, bl = pid, p
            elif br is None or self._better(p, br):
                best_remote, br = pid, p
        if best_local is not None:
            return best_local
        if best_remote is not None and (self.import_mask[c] or now - self.first_seen[c] >= self.config.rack_grace_s):
            return best_remote
        if (self.avail[c] == 0 and self.origin_mask[c]
                and self.origin_active < self.config.origin_inflight and now >= self.origin_backoff_until):
            return ORIGIN
        return None

    def _peer_first(self, now: float, free: int, ready: list) -> list[Request]:
        """The rarest chunks' holders are all busy: rather than idle, ask each idle peer for the
        rarest chunk *it* has (BitTorrent's order: the uploader first, then rarest among its pieces)."""
        out: list[Request] = []
        want = ~self.have & ~self.inflight_mask
        for pid, p in ready:
            if p.inflight:
                continue
            cand = np.flatnonzero(p.bits & want)
            if p.rack != self.rack:
                cand = cand[self.import_mask[cand] | (now - self.first_seen[cand] >= self.config.rack_grace_s)]
            if len(cand) == 0:
                continue
            c = int(cand[np.argmin(self.avail[cand].astype(np.int64) * self.n_chunks + self.tiebreak[cand])])
            self._add_request(c, pid)
            want[c] = False
            out.append(Request(c, pid))
            if len(out) >= free:
                break
        return out

    @staticmethod
    def _better(a: PeerState, b: PeerState) -> bool:
        return (a.inflight, -a.rate) < (b.inflight, -b.rate)

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
                 "chunks": int(p.bits.sum())} for pid, p in sorted(self.peers.items())]
