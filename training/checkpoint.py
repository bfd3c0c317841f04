"""Durable training checkpoints: sharded (``torch.distributed.checkpoint``), asynchronous with one in
flight, and complete only once marked.

Layout: ``<root>/step-<n>/`` holds DCP's shard files and ``.metadata``; ``complete.json`` (written by
rank 0 once its save future resolves, which DCP resolves only after every rank's shards and the
metadata are written) records the step, the world size and each file's SHA-256. A directory without
the mark, or whose files no longer match it, is refused and the previous complete one is used. DCP
loads at any world size (replicated DDP state is stored once; sharded state is resharded on load).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger("weightcast.training.checkpoint")

MARK = "complete.json"


@dataclass(frozen=True)
class Complete:
    step: int
    path: Path


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _digests(path: Path) -> dict[str, str]:
    out = {}
    for f in sorted(path.iterdir()):
        if f.is_file() and f.name != MARK:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            out[f.name] = h.hexdigest()
    return out


def mark_complete(path: Path, step: int, world_size: int) -> None:
    tmp = path / (MARK + ".tmp")
    tmp.write_text(json.dumps({"step": step, "world_size": world_size, "files": _digests(path)}))
    os.replace(tmp, path / MARK)


def check(path: Path) -> str | None:
    """Why this checkpoint cannot be used, or None if it is complete and intact."""
    try:
        mark = json.loads((path / MARK).read_text())
    except FileNotFoundError:
        return "not marked complete (a save that did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable completion mark: {e}"
    if ".metadata" not in mark.get("files", {}):
        return "no DCP metadata recorded"
    got = _digests(path)
    bad = sorted(n for n, d in mark["files"].items() if got.get(n) != d)
    return f"files changed or missing since the save: {', '.join(bad)}" if bad else None


def latest(root: Path) -> Complete | None:
    """The newest complete, intact checkpoint; broken ones are logged and skipped."""
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*"), reverse=True):
        why = check(path)
        if why is None:
            return Complete(int(json.loads((path / MARK).read_text())["step"]), path)
        log.warning("checkpoint %s refused (%s); trying the previous one", path.name, why,
                    extra={"path": str(path), "reason": why})
    return None


class Checkpointer:
    """One rank's side of checkpointing. ``save`` returns the time training was blocked: DCP stages
    the state (a copy) and writes it in a background thread; a second save first waits for the first."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int = 3):
        self.root, self.rank, self.world, self.keep = root, rank, world_size, keep
        # the background save runs its own collectives (gathering the shards' metadata): on the
        # training group they would interleave with DDP's all-reduces and hang both
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: tuple[Future, int, Path] | None = None
        self.last_complete: int | None = None

    def save(self, step: int, state: dict, asynchronous: bool = True) -> float:
        t0 = time.perf_counter()
        self.wait()
        path = step_dir(self.root, step)
        if asynchronous:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
            # marked from the save's own thread the moment it finishes, so a rank that dies a step
            # later still leaves it usable
            fut.add_done_callback(lambda f: f.exception() is None and self._finished(step, path))
            self.pending = (fut, step, path)
        else:
            dcp.save(state, checkpoint_id=path, process_group=self.group)
            self._finished(step, path)
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk and marked."""
        if self.pending is None:
            return
        fut, _, _ = self.pending
        self.pending = None
        fut.result()                        # raises if the save failed; the callback has marked it

    def poll(self) -> None:
        """Mark the save in flight if it has finished, without blocking."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def _finished(self, step: int, path: Path) -> None:
        if self.rank == 0 and not (path / MARK).exists():
            mark_complete(path, step, self.world)
            for old in sorted(self.root.glob("step-*"))[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.last_complete = step

    def load(self, path: Path, state: dict) -> None:
        dcp.load(state, checkpoint_id=path, process_group=self.group)
