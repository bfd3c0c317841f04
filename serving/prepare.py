"""Reading a version's files ahead of its load, while the rest is still arriving.

The host activity tells the model server how many of the manifest's files, in order, peerd has
verified whole (``POST /v1/prepare``); each is read and hashed against the signed manifest once, as
the load would (``VerifiedFiles``), and kept in memory for the load to take (serving/verified_read).
So a staged load waits only for what needs every byte (building the model, the smoke test), and the
reading and hashing happen while the swarm finishes and while other hosts take their load turns.

It only uses CPU nobody else wants: its threads run at the lowest priority (nice 19), so the host's
own peerd, still receiving and serving chunks, is never slowed by it (measured on one 2-core machine
running four hosts, reading ahead at normal priority slowed their swarm by a third).

Bounds: one version at a time (a prepare for another drops the last), at most ``max_bytes`` held
(files past it are read by the load), and a load stops the reading before it starts so that no file
is read twice at once. Nothing read ahead is trusted more than a load's own read: it is the same
hash against the same manifest, and the bytes kept are the bytes hashed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from serving import verified_read
from serving.verified_read import VerifiedFiles, VerifyError

log = logging.getLogger("serving.prepare")


def lowest_priority() -> None:
    """This thread (a Linux task of its own) at nice 19: scheduled only when the CPU is otherwise idle."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def default_max_bytes() -> int:
    """A quarter of this machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


@dataclass
class _Ahead:
    key: tuple[str, str]       # (model, version)
    model_dir: Path
    files: VerifiedFiles
    want: int = 0              # files, in manifest order, peerd has verified whole
    next: int = 0              # the next file to read
    held: int = 0              # bytes read and kept
    stop: bool = False
    task: asyncio.Task | None = None
    read: list[str] = field(default_factory=list)


class Preparer:
    def __init__(self, max_bytes: int | None = None, on_bytes=None):
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.on_bytes = on_bytes or (lambda n: None)      # bytes read ahead (a metric)
        self.cur: _Ahead | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="read-ahead", initializer=lowest_priority)

    async def want(self, key: tuple[str, str], model_dir: Path, files: int) -> dict:
        """Read the first ``files`` files of the version at ``model_dir`` ahead (those not read yet)."""
        cur = self.cur
        if cur is None or cur.model_dir != model_dir or cur.key != key:
            if cur is not None:
                await self._end(cur)
            try:
                vf = await asyncio.to_thread(VerifiedFiles, model_dir, None, lowest_priority)
            except VerifyError as e:
                raise ValueError(str(e)) from None
            cur = self.cur = _Ahead(tuple(key), model_dir, vf)
        cur.want = max(cur.want, min(files, len(cur.files.manifest.files)))
        if not cur.stop and (cur.task is None or cur.task.done()):
            cur.task = asyncio.create_task(self._read(cur))
        return {"files_wanted": cur.want, "files_read": len(cur.read), "bytes_held": cur.held}

    async def _read(self, a: _Ahead) -> None:
        entries = a.files.manifest.files
        while a.next < a.want and not a.stop:
            entry = entries[a.next]
            if a.held + entry.size > self.max_bytes:
                log.info("read-ahead stops at its memory bound", extra={"bytes_held": a.held, "file": entry.path})
                a.stop = True
                return
            try:
                buf = await asyncio.get_running_loop().run_in_executor(self._reader, a.files.read, entry.path)
            except VerifyError as e:
                # the load reads it again and fails with the same reason, where it is reported
                log.warning("read-ahead refused a file", extra={"file": entry.path, "error": str(e)})
                a.stop = True
                return
            if self.cur is not a:                  # dropped while reading: not kept
                return
            verified_read.offer(a.model_dir, entry.path, buf)
            a.read.append(entry.path)
            a.held += entry.size
            a.next += 1
            self.on_bytes(entry.size)

    async def stop(self, model_dir: Path) -> int:
        """Before loading ``model_dir``: no more reading ahead (what was read stays for the load).
        Returns the bytes read ahead for it."""
        a = self.cur
        if a is None or a.model_dir != model_dir:
            return 0
        a.stop = True
        if a.task is not None:
            await asyncio.gather(a.task, return_exceptions=True)
        return a.held

    async def forget(self, model_dir: Path) -> int:
        """After the load: free whatever it did not take; the bytes freed."""
        if self.cur is not None and self.cur.model_dir == model_dir:
            return await self._end(self.cur)
        return verified_read.drop(model_dir)

    async def forget_version(self, key: tuple[str, str]) -> None:
        """The version is unloaded or discarded: free what was read ahead for it."""
        if self.cur is not None and self.cur.key == tuple(key):
            await self._end(self.cur)

    async def _end(self, a: _Ahead) -> int:
        a.stop = True
        if a.task is not None:
            await asyncio.gather(a.task, return_exceptions=True)
        if self.cur is a:
            self.cur = None
        return verified_read.drop(a.model_dir)
