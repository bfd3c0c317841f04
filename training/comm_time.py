"""How much of a step the collectives take: one step in every ``every`` runs under the torch profiler,
and the wall time during which any collective (gloo's or NCCL's own events) was in flight is that
step's communication time; the rest is compute (and the Python around it). A collective overlapping
backward counts as communication for as long as it runs: the split says how long the step would
take with free communication only when nothing overlaps, and bounds it otherwise."""
from __future__ import annotations

import contextlib
import os
import time

import torch

COLLECTIVE_PREFIXES = ("gloo:", "nccl:")


def _in_flight(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` (in their unit)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


@contextlib.contextmanager
def _stderr_to(path: str | None):
    """fd 2 into ``path`` for a moment: kineto prints a line to stderr at every profiler start and stop."""
    if path is None:
        yield
        return
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)


class CommTimer:
    def __init__(self, every: int, device: torch.device, first: int = 2, log: str | None = None):
        self.every, self.device, self.first, self.log = every, device, first, log
        # (step, seconds with a collective in flight, the profiled step's wall seconds)
        self.samples: list[tuple[int, float, float]] = []

    @contextlib.contextmanager
    def around(self, step: int):
        if step < self.first or (step - self.first) % self.every:
            yield
            return
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=acts)
        with _stderr_to(self.log):
            prof.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            with _stderr_to(self.log):
                prof.stop()
        # kineto's raw events: ``prof.events()`` builds a FunctionEvent tree of every op first, which
        # took ~70 % of a small DDP rank's time at one profiled step in ten
        spans = [(e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                 if e.name().lower().startswith(COLLECTIVE_PREFIXES) or "nccl" in e.name().lower()]
        self.samples.append((step, _in_flight(spans) / 1e9, wall))
