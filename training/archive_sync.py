"""Keeping a run's archive in step with its checkpoint directory, from the host worker's train_rank
activity: rank 0's host copies each newly completed checkpoint in the background (one upload at a
time, always the newest), and every attempt first restores a checkpoint the archive has and the
volume lacks. An archive failure is logged and retried with the next checkpoint: it never stops
training."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from peerd.origin import OriginError, OriginSpec, S3Origin
from training.archive import archive, newest_archived, restore
from training.checkpoint_files import MARK, step_of

log = logging.getLogger("weightcast.training.archive")


def newest_marked(root: Path) -> Path | None:
    """The newest step directory with a completion mark (checked fully only when loaded)."""
    marked = [p for p in root.glob("step-*") if (p / MARK).is_file()] if root.is_dir() else []
    return max(marked, default=None, key=lambda p: p.name)


class Archiver:
    def __init__(self, where: dict, root: Path):
        self.spec = OriginSpec(where["endpoint"], where["bucket"], where.get("prefix", ""))
        self.root = root
        self.archived: str | None = None        # the newest checkpoint known to be in the archive
        self._task: asyncio.Task | None = None

    async def restore_if_newer(self) -> None:
        async with S3Origin(self.spec) as o:
            try:
                await o.ensure_bucket()
                step = await newest_archived(o)
            except OriginError as e:
                log.warning("checkpoint archive unreadable (%s): resuming from the volume only", e)
                return
            local = newest_marked(self.root)
            if step is None or (local is not None and step_of(local) >= step):
                return
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                await restore(o, step, self.root)
            except (OriginError, BotoCoreError, ClientError, OSError, ValueError) as e:
                log.warning("archived checkpoint step-%08d not restored (%s): resuming from the volume only",
                            step, e, extra={"step": step})

    def archive_soon(self) -> None:
        """Start copying the newest complete checkpoint unless it is archived or an upload is running."""
        if self._task is not None and not self._task.done():
            return
        if self._task is not None and self._task.exception() is not None:
            log.warning("checkpoint archive upload failed (%s); the next checkpoint retries",
                        self._task.exception(), extra={"archive": f"s3://{self.spec.bucket}/{self.spec.prefix}"})
        newest = newest_marked(self.root)
        self._task = None
        if newest is not None and newest.name != self.archived:
            self._task = asyncio.ensure_future(self._upload(newest))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def archive_newest(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        newest = newest_marked(self.root)
        if newest is not None and newest.name != self.archived:
            await self._upload(newest)

    async def _upload(self, path: Path) -> None:
        async with S3Origin(self.spec) as o:
            await o.ensure_bucket()
            await archive(o, path)
        self.archived = path.name
