"""Operator requests that reach running ranks at a step boundary: pause, and checkpoint now.

The workflow writes them to a small JSON file on rank 0's host (``set_run_control``); rank 0 reads it
after every step and broadcasts it, so every rank acts at the same step (a checkpoint is a collective).
Rank 0's clock travels the same way: a checkpoint due by time (``checkpoint_every_s``) is due on every
rank at the same step, whatever their own clocks say.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lib.atomic import write_atomic


@dataclass
class Control:
    pause: bool = False
    checkpoint_seq: int = 0           # bumped by every checkpoint-now request
    time_due: bool = False            # rank 0: checkpoint_every_s has passed since the last save


def read(path: Path) -> Control:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return Control()
    return Control(bool(d.get("pause", False)), int(d.get("checkpoint_seq", 0)))


def write(path: Path, control: Control) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(control)))


def agree(path: Path, rank: int, group, time_due: bool = False) -> Control:
    """Rank 0's reading of the file (and of its clock: ``time_due``), on every rank."""
    import torch                     # here: host workers write controls without importing torch
    import torch.distributed as dist
    mine = read(path) if rank == 0 else Control()
    mine.time_due = time_due if rank == 0 else False
    if group is None:
        return mine
    t = torch.tensor([int(mine.pause), mine.checkpoint_seq, int(mine.time_due)], dtype=torch.int64)
    dist.broadcast(t, 0, group=group)
    return Control(bool(t[0]), int(t[1]), bool(t[2]))
