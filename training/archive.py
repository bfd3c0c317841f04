"""Complete checkpoints copied to object storage and restored from it.

The checkpoint directory (a volume every rank reaches) is the fast path; the archive under
``s3://bucket/<prefix>/step-<n>/`` (the rollouts' S3 origin) is what survives losing that volume.
A checkpoint is archived only once complete: its files first, its completion mark last, so an
archived mark means every file listed in it is there. A restore downloads into a private directory,
checks every file against the mark, and only then renames it into place.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from peerd.origin import S3Origin
from training.checkpoint_files import MARK, check, step_dir

log = logging.getLogger("weightcast.training.archive")


async def archive(origin: S3Origin, path: Path) -> bool:
    """Upload one complete checkpoint directory; False if the archive already has it."""
    name = path.name
    if await origin.read_object(f"{name}/{MARK}") is not None:
        return False
    mark = json.loads((path / MARK).read_text())
    for f in sorted(mark["files"]):
        await origin.put_file(f"{name}/{f}", path / f)
    await origin.put_file(f"{name}/{MARK}", path / MARK)        # last: marks a complete upload
    log.info("checkpoint %s archived", name, extra={"checkpoint": name, "files": len(mark["files"])})
    return True


async def newest_archived(origin: S3Origin) -> int | None:
    steps = [int(p.split("/")[0].removeprefix("step-")) for p, _ in await origin.list_files()
             if p.endswith(f"/{MARK}") and p.startswith("step-")]
    return max(steps, default=None)


async def restore(origin: S3Origin, step: int, root: Path) -> Path:
    """The archived checkpoint at ``step`` as ``root/step-<n>`` (verified before it appears)."""
    final = step_dir(root, step)
    tmp = root / f".restoring-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        mark = await origin.read_object(f"{final.name}/{MARK}")
        for f in json.loads(mark)["files"]:
            await origin.download_file(f"{final.name}/{f}", tmp / f)
        (tmp / MARK).write_bytes(mark)
        why = check(tmp)
        if why is not None:
            raise ValueError(f"the archived checkpoint {final.name} does not match its mark: {why}")
        if final.exists():                 # another rank (same volume) restored it first
            return final
        os.replace(tmp, final)
        log.warning("checkpoint %s restored from the archive", final.name, extra={"checkpoint": final.name})
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
