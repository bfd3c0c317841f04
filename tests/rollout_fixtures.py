"""A published, signed checkpoint on the embedded stack (real dev server, peerd, S3, model servers)."""
from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

from lib.netns import Topology
from peerd import manifest as mf
from peerd.origin import OriginSpec, S3Origin
from serving.checkpoint import write_checkpoint
from tests.fleet import publish
from tests.serving_fixtures import SMALL
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3
from workflows.types import RolloutInput


class Stack:
    """The embedded stack plus a published, signed checkpoint, for one test."""

    async def start(self, tmp: Path, seaweed, keys, ids: list[str], rate: float | None = None,
                    supervise: bool = False, net: Topology | None = None, temporal=None, withhold: bool = False):
        """On a kernel network (``net``) the origin is the stack's own, in the origin's namespace:
        ``seaweed`` is not used. ``temporal`` (the conftest fixture): the run's Temporal server, in the
        test's own namespace; without it the stack starts a server of its own (tests that stop it).
        ``withhold``: the checkpoint's last file stays out of the origin until ``release()``, so no
        download can finish before then, however fast or slow the machine."""
        self._own_s3 = None
        if net is not None:
            seaweed = self._own_s3 = await asyncio.to_thread(
                SeaweedS3(tmp / "s3", ip=net.origin.addr, prefix=tuple(net.origin.run())).start)
        src = write_checkpoint(tmp / "ckpt", SMALL, seed=5, shard_bytes=64 * 1024, version="v1")
        self.m = mf.build_from_directory(src, "tiny", "v1", chunk_size=64 * 1024)
        self.signed = json.dumps(mf.sign_manifest(self.m, keys["private"]))
        self.withheld = self.m.files[-1].path if withhold else None
        published = src
        if withhold:
            published = tmp / "ckpt-published"
            shutil.copytree(src, published, ignore=lambda d, names: [n for n in names
                                                                      if Path(d, n) == src / self.withheld])
        self.origin = await publish(seaweed, published, f"r/{uuid.uuid4().hex[:8]}")
        self.src, self.tmp, self.seaweed, self.keys = src, tmp, seaweed, keys
        self.stack = await EmbeddedStack(tmp / "stack", keys["pub_path"], ids, s3=seaweed, rate=rate,
                                         supervise=supervise, net=net,
                                         **(temporal.stack_args() if temporal else {})).start()
        self.client, self.servers = self.stack.client, self.stack.model_servers
        self.router_addr, self.hosts = self.stack.router_addr, self.stack.hosts
        return self

    async def release(self) -> None:
        """The withheld file into the origin: downloads can finish."""
        spec = OriginSpec(self.origin["endpoint"], self.origin["bucket"], self.origin["prefix"])
        async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
            await o.put_file(self.withheld, self.src / self.withheld)

    def input(self, **kw) -> RolloutInput:
        kw.setdefault("model", "tiny")
        kw.setdefault("version", "v1")
        kw.setdefault("signed_manifest", self.signed)
        kw.setdefault("origin", self.origin)
        kw.setdefault("step_wait_s", 0.2)
        return RolloutInput(hosts=list(self.hosts), router=self.router_addr, **kw)

    async def publish(self, model: str, version: str, seed: int, config=SMALL) -> dict:
        """Another signed checkpoint in S3: the ``input()`` fields that roll it out."""
        src = write_checkpoint(self.tmp / f"ckpt-{model}-{version}", config, seed=seed, shard_bytes=64 * 1024,
                               version=version)
        m = mf.build_from_directory(src, model, version, chunk_size=64 * 1024)
        origin = await publish(self.seaweed, src, f"r/{uuid.uuid4().hex[:8]}")
        return {"model": model, "version": version, "origin": origin,
                "signed_manifest": json.dumps(mf.sign_manifest(m, self.keys["private"]))}

    async def stop(self):
        await self.stack.stop()
        if self._own_s3 is not None:
            await asyncio.to_thread(self._own_s3.stop)
