"""Membership without a coordinator: who is out there, what they hold, who is dead."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


POOL_TTL = 1.0


@dataclass
class Member:
    id: str
    addr: str
    rack: str
    last_heard: float = 0.0          # 0 = known only from a seed list or hearsay
    probed: float = 0.0              # first time this host gossiped to it (0 = never tried)
    dead: bool = False
    versions: dict[str, str] = field(default_factory=dict)   # vid -> packed bitmap (as received)


class Membership:
    def __init__(self, me: dict, dead_after: float, clock=time.monotonic, rng: random.Random | None = None,
                 max_members: int = 10_000):
        self.me = me
        self.max_members = max_members     # gossip is client input: membership must not grow without bound
        self.dead_after = dead_after
        self.clock = clock
        self.rng = rng or random.Random()
        self.members: dict[str, Member] = {}
        self._pool: list[Member] = []               # live members to sample hearsay from, rebuilt ...
        self._pool_at = -POOL_TTL                   # ... at most every POOL_TTL seconds

    def learn(self, peer: dict) -> Member | None:
        """A peer heard of (seed list or gossip hearsay); never overrides direct knowledge."""
        if peer["id"] == self.me["id"]:
            return None
        m = self.members.get(peer["id"])
        if m is None:
            if len(self.members) >= self.max_members and not self._evict_one_dead():
                return None
            m = self.members[peer["id"]] = Member(peer["id"], peer["addr"], peer.get("rack", ""))
        return m

    def _evict_one_dead(self) -> bool:
        for mid, m in self.members.items():
            if m.dead:
                del self.members[mid]
                return True
        return False

    def heard_from(self, peer: dict, versions: dict[str, str]) -> tuple[Member | None, bool]:
        """Direct contact. Returns the member (None when membership is full of live members) and
        whether it came back from the dead."""
        m = self.learn(peer)
        if m is None:
            return None, False
        m.addr, m.rack = peer["addr"], peer.get("rack", "")
        revived = m.dead
        m.dead = False
        m.last_heard = self.clock()
        m.versions = dict(versions)        # a peer sends all it holds: replace, never accumulate
        return m, revived

    def touch(self, member_id: str) -> bool:
        """Direct contact without a full message (HAVE-stream news). False for a member not known or
        believed dead: only a full message (within a gossip interval) brings one back."""
        m = self.members.get(member_id)
        if m is None or m.dead:
            return False
        m.last_heard = self.clock()
        return True

    def sweep(self) -> list[Member]:
        """Mark members silent for ``dead_after`` as dead; return the newly dead. A member never heard
        from is judged from the first time this host gossiped to it, not from this host's start: in
        a fleet started together (or a large one) an alive member may simply not have been reached
        yet, and a seeder wrongly believed dead has its stripe read again by the others."""
        now = self.clock()
        out = []
        for m in self.members.values():
            ref = m.last_heard or m.probed
            if ref and not m.dead and now - ref > self.dead_after:
                m.dead = True
                out.append(m)
        return out

    def mark_dead(self, member_id: str) -> bool:
        m = self.members.get(member_id)
        if m and not m.dead:
            m.dead = True
            return True
        return False

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if not m.dead]

    def gossip_targets(self, fanout: int, always: set[str], probe: set[str] = frozenset()) -> list[Member]:
        """``fanout`` random members (dead ones too, rarely, so a recovered host is found again), the
        live members of ``always``, and every member of ``probe`` alive or not (a seeder's fellow
        seeders: one believed dead has its origin stripe read by others, so a mistake costs origin
        reads, and random gossip alone may not reach a given member within ``dead_after``)."""
        named = always | probe
        live = [m for m in self.live() if m.id not in named]
        dead = [m for m in self.members.values() if m.dead and m.id not in named]
        picks = self.rng.sample(live, min(fanout, len(live)))
        if dead and self.rng.random() < 0.2:
            picks.append(self.rng.choice(dead))
        picks += [self.members[i] for i in named if i in self.members and (i in probe or not self.members[i].dead)]
        now = self.clock()
        for m in picks:
            m.probed = m.probed or now
        return picks

    def sample_peers(self, k: int) -> list[dict]:
        """Hearsay for a gossip message. Every message carries some, and listing the live members
        costs 0.2 ms at 10,000 members: the pool is rebuilt at most every POOL_TTL seconds (a member
        dead for under a second may still be named; hearsay never overrides direct knowledge)."""
        now = self.clock()
        if now - self._pool_at >= POOL_TTL:
            self._pool, self._pool_at = self.live(), now
        live = self._pool
        return [{"id": m.id, "addr": m.addr, "rack": m.rack} for m in self.rng.sample(live, min(k, len(live)))]
