"""A small real fleet for integration tests: peerd processes on loopback, origin in SeaweedFS."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp

from peerd import manifest as mf
from peerd.client import PeerdClient
from peerd.origin import OriginSpec, S3Origin
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from lib.ports import free_ports
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY

TOKEN = "test-token"


class Fleet:
    def __init__(self, root: Path, s3, pub_path: Path, ids: list[str], rate: float | None = None,
                 corrupt: set[str] = frozenset(), extra: dict | None = None):
        self.root, self.s3, self.ids = root, s3, ids
        self.ports = dict(zip(ids, free_ports(len(ids))))
        self.procs = {}
        for i in ids:
            args = fleet_args(i, self.ports, trusted_key=pub_path, rate=rate, origin_rate=None,
                              extra=(["--fault-corrupt-uploads"] if i in corrupt else []) +
                              ["--dead-after", "2"] + (extra or {}).get(i, []))
            self.procs[i] = PeerdProc(i, self.ports[i], root / i / "store", args, env=s3.env(), token=TOKEN)

    def start(self, ids=None):
        for i in ids or self.ids:
            self.procs[i].start()
        return self

    def stop(self):
        for p in self.procs.values():
            p.stop()

    def client(self, i: str) -> PeerdClient:
        return PeerdClient(self.procs[i].addr, TOKEN)


async def publish(s3, checkpoint: Path, prefix: str) -> dict:
    spec = OriginSpec(s3.endpoint, s3.bucket, prefix)
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        await o.ensure_bucket()
        await o.upload_directory(checkpoint)
    return {"endpoint": s3.endpoint, "bucket": s3.bucket, "prefix": prefix}


async def wait_all(fleet: Fleet, ids, vid: str, timeout: float = 60) -> dict[str, dict]:
    out = {}
    for i in ids:
        async with fleet.client(i) as c:
            out[i] = await c.wait(vid, timeout)
    return out


def host_files_match(fleet: Fleet, i: str, m: mf.Manifest, checkpoint: Path) -> bool:
    model = fleet.root / i / "store" / "versions" / m.digest / "model"
    return all((model / f.path).read_bytes() == (checkpoint / f.path).read_bytes() for f in m.files)


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def manifest_json(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def run(coro):
    return asyncio.run(coro)


async def call(method: str, url: str, **kw) -> tuple[int, object]:
    """One HTTP request in a session of its own: (status, JSON body or None)."""
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, **kw) as r:
            return r.status, await r.json(content_type=None)
