"""Fair sharing of links among flows, as concurrent TCP flows through token buckets settle.

Each flow crosses two links: its uploader's and its downloader's. ``max_min_rates`` approximates the
max-min fair allocation by parallel water-filling: every round, each unfrozen flow grows by the
smaller of its two links' even split of their remaining capacity, and flows on a full link freeze.
No link ever exceeds its capacity. Vectorised over all flows: a few ``bincount``s per round.
"""
from __future__ import annotations

import numpy as np


def max_min_rates(src: np.ndarray, dst: np.ndarray, up_cap: np.ndarray, down_cap: np.ndarray,
                  rounds: int = 6) -> np.ndarray:
    nu, nd = len(up_cap), len(down_cap)
    r = np.zeros(len(src))
    left_u, left_d = up_cap.astype(float).copy(), down_cap.astype(float).copy()
    active = np.ones(len(src), bool)
    for _ in range(rounds):
        n_u = np.bincount(src[active], minlength=nu)
        n_d = np.bincount(dst[active], minlength=nd)
        # each active flow grows by the smaller of its two links' even split of what is left: a
        # link never overfills, and the scarcer link of each flow fills up this round
        inc = np.minimum(left_u[src] / np.maximum(n_u[src], 1), left_d[dst] / np.maximum(n_d[dst], 1))
        inc[~active] = 0.0
        r += inc
        left_u -= np.bincount(src, inc, minlength=nu)
        left_d -= np.bincount(dst, inc, minlength=nd)
        active &= (left_u[src] > 1e-9 * up_cap[src]) & (left_d[dst] > 1e-9 * down_cap[dst])
        if not active.any():
            break
    return r


def scale_to_caps(r: np.ndarray, links: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Scale down every flow on an overfull link so that no link carries more than its capacity."""
    f = np.ones_like(r)
    for idx, cap in links:
        use = np.bincount(idx, r, minlength=len(cap))
        over = np.where(use > cap, cap / np.maximum(use, 1e-300), 1.0)
        f = np.minimum(f, over[idx])
    return r * f


def rates_with_priority(src: np.ndarray, dst: np.ndarray, up_cap: np.ndarray, down_cap: np.ndarray,
                        first: np.ndarray) -> np.ndarray:
    """Fair shares where the ``first`` flows are served before the rest on their downloader's link:
    a seeder's origin reads skip its download queue in peerd (the origin must never idle)."""
    r = np.zeros(len(src))
    if first.any():
        r[first] = max_min_rates(src[first], dst[first], up_cap, down_cap)
    rest = ~first
    if rest.any():
        left_down = down_cap - np.bincount(dst[first], r[first], minlength=len(down_cap))
        left_up = up_cap - np.bincount(src[first], r[first], minlength=len(up_cap))
        r[rest] = max_min_rates(src[rest], dst[rest], np.maximum(left_up, 0), np.maximum(left_down, 0))
    return r
