"""Durable training checkpoints: sharded (``torch.distributed.checkpoint``), asynchronous with one in
flight, and complete only once marked.

Layout: ``<root>/step-<n>/`` holds DCP's shard files and ``.metadata``. When its save finishes, each
rank hashes only the files it wrote (``__<rank>_*.distcp``; rank 0 also ``.metadata``) and writes
``digests-<rank>.json``: at hundreds of GB the hashing is spread over the ranks instead of one rank
re-reading everything. ``complete.json`` merges them (step, world size, each file's size and SHA-256);
rank 0 writes it once every rank's digests are there (or a later resume does, from the same files).
A directory without the mark, or whose files no longer match it, is refused and the previous complete
one is used; on resume the ranks verify a share of the files each and agree on the newest good one.
DCP loads at any world size (replicated DDP state is stored once; sharded state is resharded on load).

Node-local checkpoint directories (``local``: each host its own disk, no shared volume): the ranks
swap their digests through the process group's store and each writes the merged list as
``merged.json`` on its own disk; the host then replicates the checkpoint through peerd's swarm
(training/checkpoint_swarm.py) and writes ``complete.json`` once every file is there.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lib.atomic import write_atomic
from training.checkpoint_files import (CHUNK_SIZE, MARK, MERGED, Complete, check, mark_bytes, step_dir, step_of,
                                       try_mark, write_digests)

log = logging.getLogger("weightcast.training.checkpoint")

def latest(root: Path, group=None, shared: bool = True) -> Complete | None:
    """The newest complete, intact checkpoint; broken ones are logged and skipped. With ``group`` (every
    rank calls it) all agree on the newest good one; on a ``shared`` volume each rank hashes a share of
    the files, on node-local disks each hashes its own copy whole."""
    if not root.is_dir() and group is None:
        return None
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    names = {p.name for p in root.glob("step-*")}
    if group is not None:                   # node-local directories differ: every rank walks the same list
        everyone: list = [None] * world
        dist.all_gather_object(everyone, sorted(names), group=group)
        names = set().union(*everyone)
    for path in [root / n for n in sorted(names, reverse=True)]:
        why = check(path, (rank, world) if shared else (0, 1)) if path.is_dir() else "not on this rank's disk"
        if group is not None:               # one bad file anywhere refuses it for every rank
            flag = torch.tensor([0 if why is None else 1])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() and why is None:
                why = "another rank found a file changed or missing"
        if why is None:
            return Complete(int(json.loads((path / MARK).read_text())["step"]), path)
        log.warning("checkpoint %s refused (%s); trying the previous one", path.name, why,
                    extra={"path": str(path), "reason": why})
    return None


class Checkpointer:
    """One rank's side of checkpointing. An asynchronous save returns at once: DCP copies the state
    (staging) and writes it in background threads. The copy must finish before the weights change, so
    the training loop calls ``before_update`` ahead of each optimiser step; the copy overlaps the next
    forward and backward. A second save first waits for the first to be on disk."""

    def __init__(self, root: Path, rank: int, world_size: int, keep: int = 3, local: bool = False):
        self.root, self.rank, self.world, self.keep = root, rank, world_size, keep
        # node-local directories: every rank keeps its own disk (set-aside, pruning, the merged digests)
        self.local = local
        self.kv = dist.distributed_c10d._get_default_store() if local and dist.is_initialized() else None
        # the background save runs its own collectives (gathering the shards' metadata): on the
        # training group they would interleave with DDP's all-reduces and hang both
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: tuple[Future, int, Path] | None = None
        self.staging: Future | None = None
        self._stager = None
        self.unmarked: list[tuple[int, Path]] = []      # saved; rank 0 marks once every rank's digests are in
        self.lock = threading.Lock()
        self.last_complete: int | None = None

    def save(self, step: int, state: dict, asynchronous: bool = True) -> float:
        t0 = time.perf_counter()
        self.wait(mark_timeout_s=0)         # the previous save on disk; its mark may follow later
        path = step_dir(self.root, step)
        if asynchronous:
            resp = dcp.async_save(state, checkpoint_id=path, process_group=self.group, async_stager=self.stager())
            self.staging, fut = resp.staging_completion, resp.upload_completion
            # marked from the save's own thread the moment it finishes, so a rank that dies a step
            # later still leaves it usable
            fut.add_done_callback(lambda f: f.exception() is None and self._finished(step, path))
            self.pending = (fut, step, path)
        else:
            dcp.save(state, checkpoint_id=path, process_group=self.group)
            self._finished(step, path)
        return time.perf_counter() - t0

    def set_aside_after(self, step: int) -> None:
        """On resume from ``step``: move every newer step directory (refused or cut short) out of the
        way before this attempt saves into the same names — a stale rank's files or digests must not
        mix with new ones. Rank 0 moves them (kept as ``set-aside-…`` for inspection; on node-local
        directories every rank its own); all wait."""
        if self.rank == 0 or self.local:
            for path in sorted(self.root.glob("step-*")):
                if step_of(path) > step:
                    aside = self.root / f"set-aside-{path.name}-{time.time_ns()}"
                    os.replace(path, aside)
                    log.warning("checkpoint %s set aside as %s: newer than the one resumed from (%d)", path.name,
                                aside.name, step, extra={"path": str(aside), "resumed_from": step})
        if self.group is not None:
            dist.barrier(group=self.group)

    def stager(self) -> DefaultStager:
        """One background copier for the run (pinned host memory when the state is on a GPU)."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager

    def before_update(self) -> float:
        """Block until the save in flight has its copy of the state: call before changing the weights.
        Returns the seconds blocked (part of that save's stall)."""
        if self.staging is None:
            return 0.0
        t0 = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t0

    def wait(self, mark_timeout_s: float = 120.0) -> None:
        """Block until the save in flight (if any) is on disk, and on rank 0 until it is marked (every
        rank's digests written)."""
        self.before_update()
        if self.pending is not None:
            fut, _, _ = self.pending
            self.pending = None
            fut.result()                    # raises if the save failed; the callback wrote our digests
        deadline = time.monotonic() + mark_timeout_s
        self._mark()
        while self.unmarked and time.monotonic() < deadline:
            time.sleep(0.01)
            self._mark()

    def poll(self) -> None:
        """Finish the save in flight and mark what can be marked, without blocking."""
        if self.pending is not None and self.pending[0].done():
            self.wait(mark_timeout_s=0)
        self._mark()

    def _finished(self, step: int, path: Path) -> None:
        raw = write_digests(path, self.rank, self.world, CHUNK_SIZE if self.local else None)
        if self.kv is not None:
            self.kv.set(f"ckpt/{step}/{self.rank}", raw)
        with self.lock:
            self.unmarked.append((step, path))
        self._mark()

    def _mark(self) -> None:
        """Rank 0 merges the completion marks whose every rank's digests are written and drops old
        checkpoints; every rank notes the newest marked one (``last_complete``, in its progress)."""
        with self.lock:                     # the save's thread and the training loop both call this
            while self.unmarked:
                step, path = self.unmarked[0]
                if self.local:
                    if not self._merge_local(step, path):
                        return
                elif not (try_mark(path, step) if self.rank == 0 else (path / MARK).exists()):
                    return
                self.unmarked.pop(0)
                self.last_complete = step
                if self.rank == 0 or self.local:
                    self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` checkpoints. Node-local: the newest ``keep`` whole on this disk, and
        every newer one still being replicated (never prune to nothing usable)."""
        dirs = sorted(self.root.glob("step-*"))
        if self.local:
            whole = [p for p in dirs if (p / MARK).is_file()]
            old = [p for p in dirs if len(whole) >= self.keep and p.name < whole[-self.keep].name]
        else:
            old = dirs[:-self.keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)

    def _merge_local(self, step: int, path: Path) -> bool:
        """Node-local: once every rank's digests are in the store, this rank's disk gets the merged list
        (its host then replicates the checkpoint and marks it complete)."""
        if self.kv is None:                 # one rank: its own digests are all of them
            parts = [json.loads((path / f"digests-{self.rank}.json").read_text())]
        else:
            keys = [f"ckpt/{step}/{r}" for r in range(self.world)]
            if not self.kv.check(keys):
                return False
            parts = [json.loads(self.kv.get(k)) for k in keys]
        write_atomic(path / MERGED, mark_bytes(step, parts))
        return True

    def load(self, path: Path, state: dict) -> None:
        dcp.load(state, checkpoint_id=path, process_group=self.group)
