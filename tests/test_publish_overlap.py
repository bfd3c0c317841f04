"""Publishing overlaps distribution without weakening trust: the manifest is signed before any byte is
uploaded and the rollout starts at once; hosts read from the origin only what is there and check
every chunk against the signed manifest, as always."""
import asyncio
import json
import uuid

import aiohttp
import pytest
from temporalio.client import WorkflowFailureError

from peerd.client import PeerdClient
from peerd.origin import OriginSpec, S3Origin
from serving.checkpoint import write_checkpoint
from tests.serving_fixtures import SMALL
from tests.waiting import until
from weightcast.publish import COMPLETE, MARKER, PublishError, PublishRequest, finish_upload, publish_and_start, stage
from weightcast.rollouts import start_rollout
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from workflows.types import ManifestRef, RolloutInput

CHUNK = 64 * 1024


async def origin_corrupt_refusals(stack: EmbeddedStack) -> int:
    n = 0
    async with aiohttp.ClientSession() as s:
        for p in stack.peerd.values():
            async with s.get(f"{p.addr}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith('peerd_chunk_failures_total{reason="origin_corrupt"}'):
                        n += int(float(line.split()[-1]))
    return n


async def stored_versions(stack: EmbeddedStack, host: str) -> list[str]:
    async with PeerdClient(stack.peerd[host].addr, stack.token) as c:
        return [v["version_id"] for v in (await c.status()).get("stored", [])]


@pytest.fixture
async def stack(tmp_path, seaweed, keys, temporal):
    s = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], ["a", "b"], s3=seaweed,
                            **temporal.stack_args()).start()
    yield s
    await s.stop()


def request(tmp_path, seaweed, keys) -> PublishRequest:
    src = write_checkpoint(tmp_path / "ckpt", SMALL, seed=5, shard_bytes=CHUNK, version="v1")
    return PublishRequest(src, "tiny", "v1", keys["priv_path"],
                          OriginSpec(seaweed.endpoint, seaweed.bucket, f"overlap/{uuid.uuid4().hex[:8]}"),
                          chunk_size=CHUNK, access_key=ACCESS_KEY, secret_key=SECRET_KEY)


async def test_bytes_altered_at_the_origin_during_the_overlap_are_refused_until_the_publish_lands(
        tmp_path, seaweed, keys, stack):
    req = request(tmp_path, seaweed, keys)
    staged = await stage(req)                        # signed; no byte uploaded yet
    victim = max(staged.manifest.files, key=lambda f: f.size)
    good = (req.source / victim.path).read_bytes()
    async with S3Origin(req.origin, ACCESS_KEY, SECRET_KEY) as o:
        # mid-upload: the other files are there, and someone wrote other bytes under the victim's name
        for f in staged.manifest.files:
            if f is not victim:
                await o.put_bytes(o.spec.key(f.path), (req.source / f.path).read_bytes())
        await o.put_bytes(o.spec.key(victim.path), bytes([good[0] ^ 0xFF]) + good[1:])
    origin = {"endpoint": req.origin.endpoint, "bucket": req.origin.bucket, "prefix": req.origin.prefix}
    handle = await start_rollout(stack.client, RolloutInput(
        "tiny", "v1", "", origin, list(stack.hosts), manifest=ManifestRef(staged.manifest.digest, MARKER),
        router=stack.router_addr, step_wait_s=0.0))

    await until(lambda: origin_corrupt_refusals(stack), 60, "a host refusing the altered origin bytes")
    for h in ("a", "b"):
        async with PeerdClient(stack.peerd[h].addr, stack.token) as c:
            job = await c.job(staged.manifest.digest)
        assert job["state"] == "fetching" and job["chunks_done"] < job["chunks_total"]
        assert ("tiny", "v1") not in stack.model_servers[h].versions

    pub = await finish_upload(req, staged)           # the publisher's own bytes replace them
    assert victim.path in pub.uploaded
    result = await asyncio.wait_for(handle.result(), 120)
    assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}
    assert set(result["phase_seconds"]) == {"manifest", "distribute", "verify", "load", "traffic"}   # in the history
    for h in ("a", "b"):
        held = stack.peerd[h].store / "versions" / staged.manifest.digest / "model" / victim.path
        assert held.read_bytes() == good


async def test_a_publish_that_fails_halfway_aborts_its_rollout_and_no_host_keeps_the_version(
        tmp_path, seaweed, keys, stack):
    req = request(tmp_path, seaweed, keys)
    last = sorted(p for p in req.source.iterdir() if not p.name.startswith("."))[-1]
    seen, facts_of = [], {}

    def progress(event: str, facts: dict) -> None:
        seen.append(event)
        facts_of[event] = facts
        if event == "rollout":                       # the fleet has started; the bytes have not left yet
            data = bytearray(last.read_bytes())
            data[-1] ^= 0xFF
            last.write_bytes(bytes(data))

    with pytest.raises(PublishError, match=r"differs from the signed manifest.*was aborted"):
        await publish_and_start(stack.client, req, stack.hosts, progress=progress, router=stack.router_addr,
                                step_wait_s=0.0)
    assert seen[:2] == ["signed", "rollout"] and "published" not in seen
    handle = stack.client.get_workflow_handle("rollout-tiny-v1")
    with pytest.raises(WorkflowFailureError) as e:
        await asyncio.wait_for(handle.result(), 120)
    assert "publishing failed" in str(e.value.cause)
    async with S3Origin(req.origin, ACCESS_KEY, SECRET_KEY) as o:
        assert await o.read_object(COMPLETE) is None and await o.read_object(last.name) is None
        assert json.loads(await o.read_object(MARKER))["manifest"]["version"] == "v1"
    vid = facts_of["signed"]["version_id"]    # the abort may land before or during distribution
    for h in ("a", "b"):
        assert ("tiny", "v1") not in stack.model_servers[h].versions
        await until(lambda h=h: _gone(stack, h, vid), 30, f"{h} dropping the aborted version")


async def _gone(stack: EmbeddedStack, host: str, vid: str) -> bool:
    return vid not in await stored_versions(stack, host)
