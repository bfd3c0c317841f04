"""Decision rules of the swarm policy.

``SwarmPolicy`` calls these with one row (the daemon's host). The simulator compiles the elementwise
ones (``rarity``, ``tiebreak``, ``reach_ok``, ``source_score``) into its per-host loops
(``peerd/sim/kernels.py``), so both decide by the same code. Pure functions of
their arguments; randomness comes in through seeded parameters or a passed generator.
"""
from __future__ import annotations

import numpy as np

_T = 4096                   # size of the random order table; chunk ids wrap around it
_NONE = np.iinfo(np.int32).max


def tiebreak_params(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random order over chunk ids, different on every host (so that equally rare chunks are
    picked at random and hosts do not all pick the same one): a shared random table read at a
    per-host offset."""
    return rng.permutation(_T).astype(np.int32), rng.integers(0, _T, n, dtype=np.int64)


def tiebreak_rows(table: np.ndarray, offset: np.ndarray, lo: np.ndarray, width: int) -> np.ndarray:
    """Each row's random order over the chunk ids ``lo[i] .. lo[i] + width``: ``tiebreak`` per cell."""
    return tiebreak(table, offset[:, None], lo[:, None] + np.arange(width))


def rarity_key(holders: np.ndarray, lo: np.ndarray, table: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Sort key per (row, chunk) over each row's window of chunk ids from ``lo``: fewest holders
    first, then the row's random order."""
    return rarity(holders.astype(np.int32), tiebreak_rows(table, offset, lo, holders.shape[1]))


def rarity(holders, tie):
    """The ranking key of a chunk with ``holders`` usable holders and random order ``tie`` (lower
    ranks first). Elementwise: arrays here, scalars in the simulator's compiled loops."""
    return holders * _T + tie


def tiebreak(table, offset, chunk):
    """A host's random order value of ``chunk`` (``tiebreak_rows`` for one cell)."""
    return table[(chunk + offset) & (_T - 1)]


def origin_slots(sizes: np.ndarray) -> np.ndarray:
    """Each chunk's origin slot: where it starts in the version, in units of the largest chunk.
    Striping by slot rather than by chunk index balances the seeders' origin *bytes*: a version of
    many files has a short chunk at each file's end, and by index each counts as a whole one (the
    16-host bench's 256 MiB are 258 chunks in 3 files: by index two of the 16 seeders read 17 MiB,
    and the origin's copy took 34 s instead of 32). With equal chunks, slot = index."""
    sizes = np.asarray(sizes, np.int64)
    if len(sizes) == 0:
        return sizes
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return starts // max(int(sizes.max()), 1)


def origin_owner(slots: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Which seeder reads each chunk from the origin, as a position in the job's sorted seeder list
    (-1: no seeder left). A chunk in slot ``s`` (``origin_slots``) is seeder ``s mod n``'s; a dead
    seeder's chunks are dealt round-robin over the living, and nobody else's move: re-dividing every
    stripe by the live count hands chunks already read (but not yet known to the new owner's peers)
    to a seeder that reads them again (1.02-1.03 origin copies with 5 % of hosts dying, against 1.00
    without deaths)."""
    n = len(live)
    slots = np.asarray(slots, np.int64)
    own = slots % n
    alive = np.flatnonzero(live)
    if len(alive) == 0:
        return np.full(len(slots), -1)
    dead = ~live[own]
    own[dead] = alive[(slots[dead] // n) % len(alive)]
    return own


def origin_order(stripe: np.ndarray, slots: np.ndarray, stride: int, spread: int, table: np.ndarray,
                 offset: np.ndarray, row: int) -> np.ndarray:
    """A seeder's next origin reads, best first: its remaining stripe (chunks in ``slots`` ``stride``
    apart) in blocks of ``spread`` stripe positions, block by block, in the row's random order inside
    a block. The fleet works through the file nearly in order (no chunk waits more than a block),
    and two seeders that briefly disagree on who owns a stripe rarely read the same chunk."""
    block = (slots // max(stride, 1)) // max(spread, 1)
    key = block.astype(np.int64) * _T + table[(stripe + offset[row]) & (_T - 1)]
    return stripe[np.argsort(key, kind="stable")]


def rank_window(want: np.ndarray, holders: np.ndarray, lo: np.ndarray, table: np.ndarray,
                offset: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rarest first: for each row, the ``k`` wanted chunks held by the fewest known peers (random
    order among equals), best first.

    Inputs are (rows, window) over each row's chunk ids ``lo[i] .. lo[i] + window``: whether the host
    wants the chunk (lacks it and has not asked for it) and how many usable peers hold it; a chunk
    nobody holds is never ranked. Returns (chunk ids, valid) of shape (rows, min(k, window))."""
    if want.shape[1] == 0:
        return np.zeros((len(want), 0), np.int64), np.zeros((len(want), 0), bool)
    key = np.where(want & (holders > 0), rarity_key(holders, lo, table, offset), _NONE)
    k = min(k, key.shape[1])
    rows = np.arange(len(key))[:, None]     # indexing by (rows, columns): take_along_axis builds this per call
    if k == 1:
        idx = np.argmin(key, axis=1)[:, None]
    else:
        part = np.argpartition(key, k - 1, axis=1)[:, :k]
        idx = part[rows, np.argsort(key[rows, part], axis=1, kind="stable")]
    return lo[:, None] + idx, key[rows, idx] != _NONE


def rarest_offered(key: np.ndarray, offered: np.ndarray) -> int:
    """The position of the best-ranked (lowest ``rarity_key``) chunk among those ``offered`` in one
    window, or -1 if none is: ``rank_window`` with k = 1 for one row whose key is already known."""
    masked = np.where(offered, key, _NONE)
    i = int(np.argmin(masked))
    return i if masked[i] != _NONE else -1


def source_scores(holds: np.ndarray, same_rack: np.ndarray, mine_inflight: np.ndarray,
                  rng: np.random.Generator, rate_rank: np.ndarray | None = None) -> np.ndarray:
    """Score each candidate peer of each row (higher is better; -inf = cannot serve): a peer in the
    host's own rack first, then the one this host has fewest requests in flight to, then the faster
    (``rate_rank`` in [0, 1)), then at random. The weights keep that order strict for any per-peer
    cap below a million."""
    u = rng.random(holds.shape, dtype=np.float32)
    return np.where(holds, source_score(same_rack, mine_inflight, u, 0.0 if rate_rank is None else rate_rank),
                    -np.inf)


def source_score(same_rack, mine_inflight, u, rate_rank):
    """``source_scores`` for holders, elementwise (scalars in the simulator's compiled loops)."""
    return same_rack * 4e6 - mine_inflight * 4.0 + u + 2.0 * rate_rank


def peer_budget(max_inflight: int, seeder_inflight: int, seeder: bool, seeders_in_rack: int, rack_size: int) -> int:
    """Peer requests a host keeps in flight. A seeder where seeders are under half its rack keeps
    ``seeder_inflight`` more: its origin read shares its link, and its rack-mates, the first holders of
    its fresh chunks, are everyone's most wanted uploaders and answer it busy more often. Where
    most of the rack seeds no host is special, and more requests in flight only slow each chunk."""
    return max_inflight + (seeder_inflight if seeder and 2 * seeders_in_rack < rack_size else 0)


def cross_rack_ok(dist: np.ndarray, n: np.ndarray, age: np.ndarray, grace_s: float, rescue_s: float) -> np.ndarray:
    """May a host pull these chunks from another rack? ``dist``: the host's distance, in its rack's
    stripe over live members (``n`` of them), from each chunk's importer. The importer (0) may at once;
    the backup (n // 2) after ``grace_s`` since the chunk was first seen; after ``rescue_s`` (importer
    and backup dead, cut off or without a remote source) the first 2, 4, 8, ... members, doubling every
    ``grace_s``, so a rack of 500 does not pull 500 copies across its uplink at once."""
    return reach_ok(dist, n, *import_reach(age, grace_s, rescue_s))


def import_reach(age: np.ndarray, grace_s: float, rescue_s: float) -> tuple[np.ndarray, np.ndarray]:
    """``cross_rack_ok``'s per-chunk half, from each chunk's age since first seen: whether its backup
    may import it yet, and how far from the importer the rescue widening reaches (0 before
    ``rescue_s``). The simulator computes it once per chunk instead of once per (host, chunk)."""
    later = np.maximum(age - rescue_s, 0.0)
    return age >= grace_s, np.where(age >= rescue_s, np.exp2(1.0 + np.floor(later / grace_s)), 0.0)


def reach_ok(dist: np.ndarray, n: np.ndarray, backup: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``cross_rack_ok``'s per-(host, chunk) half: the importer, the backup once allowed, and the
    members within the rescue widening."""
    return (dist == 0) | ((dist == n // 2) & backup) | (dist < width)

