"""Data imbalance: size each data-parallel rank's share of the global batch by its measured speed, so a
step takes as long as the fleet needs, not as long as its slowest rank needs for an equal share.

Each rank measures its own compute rate (samples per second of local work: making the batch, forward,
and its backward estimated at twice the forward, as for FLOPs; measured before the gradient reduction,
whose waiting would otherwise make every rank look as slow as the slowest). The rates are all-gathered
(8 bytes a rank), smoothed, and every rank computes the same shares from the same numbers (largest
remainder, each at least one sample). The gradient stays the mean over the whole global batch: each
rank scales its local mean loss by ``share * dp / global_batch`` before the reduction averages it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def proportional_shares(rates: list[float], total: int) -> list[int]:
    """``total`` samples split in proportion to ``rates``, summing exactly to ``total``, each >= 1."""
    n = len(rates)
    if total < n:
        raise ValueError(f"{total} samples cannot give each of {n} ranks one")
    spare = total - n                                  # one sample each is fixed; the rest by rate
    weight = sum(rates)
    ideal = [spare * r / weight for r in rates]
    shares = [int(x) for x in ideal]
    by_remainder = sorted(range(n), key=lambda i: (ideal[i] - shares[i], -i), reverse=True)
    for i in by_remainder[:spare - sum(shares)]:
        shares[i] += 1
    return [s + 1 for s in shares]


class Balancer:
    """One per rank. ``shares()`` is identical on every rank (it is a function of all-gathered rates)."""

    def __init__(self, global_batch: int, dp_size: int, smoothing: float = 0.5):
        self.global_batch = global_batch
        self.dp_size = dp_size
        self.smoothing = smoothing
        self.rates: list[float] | None = None          # samples/s per rank, smoothed
        self.sent_bytes = 0

    def shares(self) -> list[int]:
        if self.rates is None:                         # no measurement yet: equal shares
            base, extra = divmod(self.global_batch, self.dp_size)
            return [base + (1 if r < extra else 0) for r in range(self.dp_size)]
        return proportional_shares(self.rates, self.global_batch)

    def observe(self, samples: int, seconds: float) -> None:
        """This rank's local work for its share; a collective: every rank calls it once a step."""
        mine = torch.tensor([samples / max(seconds, 1e-9)], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
        self.sent_bytes += mine.numel() * mine.element_size()
        dist.all_gather(parts, mine)
        new = [float(p) for p in parts]
        a = self.smoothing
        self.rates = new if self.rates is None else [a * o + (1 - a) * n for o, n in zip(self.rates, new)]

    @staticmethod
    def loss_weight(share: int, dp_size: int, global_batch: int) -> float:
        """Scale of a rank's mean loss so that the averaged gradient is the global batch mean."""
        return share * dp_size / global_batch
