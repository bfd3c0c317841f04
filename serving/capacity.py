"""Capacity rules for a version swap, written down once and enforced by the router's permits.

- At most ``max_concurrent_loads`` hosts load at once (a loading host serves nothing new).
- An unload of the old version never leaves fewer than ``old_floor`` hosts ready for it while the
  new version is not yet carrying the traffic (weight 0 for the old version lifts the floor).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityRules:
    max_concurrent_loads: int = 2
    old_floor: int = 1

    def __post_init__(self):
        if self.max_concurrent_loads < 1:
            raise ValueError("max_concurrent_loads must be at least 1")
        if self.old_floor < 0:
            raise ValueError("old_floor must be at least 0")

    def may_load(self, loading_now: int) -> tuple[bool, str]:
        if loading_now >= self.max_concurrent_loads:
            return False, f"{loading_now} hosts already loading (max_concurrent_loads={self.max_concurrent_loads})"
        return True, ""

    def may_unload(self, ready_for_version: int, version_weight: float) -> tuple[bool, str]:
        """``ready_for_version`` counts the hosts ready now, the one asking included."""
        if version_weight > 0 and ready_for_version - 1 < self.old_floor:
            return False, (f"unloading would leave {ready_for_version - 1} hosts serving a version that still "
                           f"carries traffic; the floor is {self.old_floor}")
        return True, ""
