"""CPU time of this process and every process under it (the embedded stack's peerds, host workers,
SeaweedFS, the Temporal server), from /proc: a benchmark on one machine reports how much of its
cores a run kept busy, and so how far its wall time can fall on those cores."""
from __future__ import annotations

import os

_HZ = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system seconds of ``root`` (default: this process) and its live descendants."""
    root = root or os.getpid()
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue                      # gone meanwhile
        pid, ppid = int(name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / _HZ
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def cores() -> int:
    return len(os.sched_getaffinity(0))
