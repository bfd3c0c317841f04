"""Fair sharing of links among flows, as concurrent TCP flows through token buckets settle.

Each flow crosses two links: its uploader's and its downloader's. ``max_min_rates`` approximates the
max-min fair allocation by a few rounds of water-filling: a link's capacity, less what its flows
bound elsewhere take, is split evenly among the flows it binds. A last scaling keeps every link
within its capacity. Vectorised over all flows: a few ``bincount``s per round.
"""
from __future__ import annotations

import numpy as np


def max_min_rates(src: np.ndarray, dst: np.ndarray, up_cap: np.ndarray, down_cap: np.ndarray,
                  rounds: int = 4) -> np.ndarray:
    nu, nd = len(up_cap), len(down_cap)
    n_up = np.bincount(src, minlength=nu)
    n_dn = np.bincount(dst, minlength=nd)
    su = up_cap / np.maximum(n_up, 1)
    sd = down_cap / np.maximum(n_dn, 1)
    r = np.minimum(su[src], sd[dst])
    for _ in range(rounds):
        at_up = su[src] <= sd[dst]                      # the uplink is this flow's bottleneck
        cnt_u = np.bincount(src, at_up, minlength=nu)
        cnt_d = np.bincount(dst, ~at_up, minlength=nd)
        left_u = up_cap - np.bincount(src, np.where(at_up, 0.0, r), minlength=nu)
        left_d = down_cap - np.bincount(dst, np.where(at_up, r, 0.0), minlength=nd)
        su = np.where(cnt_u > 0, np.maximum(left_u, 0) / np.maximum(cnt_u, 1), np.inf)
        sd = np.where(cnt_d > 0, np.maximum(left_d, 0) / np.maximum(cnt_d, 1), np.inf)
        r = np.minimum(su[src], sd[dst])
        r = np.minimum(r, np.minimum(up_cap[src], down_cap[dst]))
    return scale_to_caps(r, [(src, up_cap), (dst, down_cap)])


def scale_to_caps(r: np.ndarray, links: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Scale down every flow on an overfull link so that no link carries more than its capacity."""
    f = np.ones_like(r)
    for idx, cap in links:
        use = np.bincount(idx, r, minlength=len(cap))
        over = np.where(use > cap, cap / np.maximum(use, 1e-300), 1.0)
        f = np.minimum(f, over[idx])
    return r * f
