"""What a simulated fleet looks like, and peerd's settings it runs with.

The swarm settings are not numbers of the simulator's own: the policy is a ``PolicyConfig`` and the
daemon-level ones (upload slots, bitmap push interval, failure detection, peers tracked) default to
``PeerdConfig``'s, so a simulated host behaves as a peerd started with no flags.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from peerd.config import default
from peerd.policy import PolicyConfig
from peerd.seeders import MAX_SEEDERS


@dataclass
class SimConfig:
    # the fleet and the file
    hosts: int = 1000
    size: float = 400e9
    chunk: int = 64 * 1024 * 1024
    rate: float = 10e9 / 8                # bytes/s, each host, up and down
    origin_rate: float | None = None      # bytes/s the origin serves in total (default: rate)
    racks: int = 20
    oversubscription: float = 1.0         # rack uplink = hosts_per_rack * rate / oversubscription
    fail_fraction: float = 0.05           # hosts that die at random times mid-run
    seeders: int = MAX_SEEDERS            # hosts that may read the origin (as many as a rollout names)
    seed: int = 1
    # peerd, as started with no flags
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    max_active_peers: int = default("max_active_peers")   # neighbours per host
    max_uploads: int = default("max_uploads")             # concurrent uploads before 503 busy
    have_interval: float = default("have_interval")       # a verified chunk reaches the active peers within this
    dead_after: float = default("dead_after")             # silence before peers call a host dead
    stall_after: float = default("stall_after")           # a download receiving nothing is given up
    # the simulator's own resolution: rounds of (choose, ask, busy?) per time step, and steps per
    # chunk-time (one is enough: a flow that ends mid-step hands the rest of the step on)
    request_rounds: int = 6
    peer_first_rounds: int = 2
    steps_per_chunk: int = 1
    plan_rows: int = 16                   # ranked chunks kept per host between re-plans (at most the
                                          # policy's plan_size; a host that uses them up re-ranks at once)

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.size / self.chunk))

    @property
    def lower_bound_s(self) -> float:
        return max(self.size / self.rate, self.size / (self.origin_rate or self.rate))


def analytic_baselines(hosts: int, size: float, rate: float, origin_rate: float) -> dict:
    """Naive pull and a binary store-and-forward tree, for the same scenario."""
    lower = max(size / rate, size / origin_rate)
    depth = max(1, int(math.floor(math.log2(hosts))))
    return {"lower_bound_s": lower,
            "naive_pull_s": max(hosts * size / origin_rate, size / rate),
            "binary_tree_s": depth * 2 * size / rate,
            "tree_depth": depth}
