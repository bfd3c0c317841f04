"""Stores that do not fill: ten successive rollouts through the real workflow, host worker, peerd and
model server; each host keeps the new version, the previous one and the pinned ones, nothing else."""
import asyncio
import json
import shutil
import uuid


from peerd import manifest as mf
from peerd.client import PeerdClient
from serving.checkpoint import write_checkpoint
from tests.fleet import publish
from tests.rollout_fixtures import Stack
from tests.serving_fixtures import SMALL
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow


def disk_bytes(path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


async def test_ten_successive_rollouts_keep_the_store_bounded(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a"], temporal=temporal)
    try:
        store = s.stack.peerd["a"].store
        sizes = []
        for i in range(1, 11):
            src = write_checkpoint(tmp_path / f"ckpt{i}", SMALL, seed=5 + i, shard_bytes=64 * 1024, version=f"v{i}")
            m = mf.build_from_directory(src, "tiny", f"v{i}", chunk_size=64 * 1024)
            origin = await publish(seaweed, src, f"ret/{uuid.uuid4().hex[:8]}")
            inp = s.input(version=f"v{i}", signed_manifest=json.dumps(mf.sign_manifest(m, keys["private"])),
                          previous_version=f"v{i - 1}" if i > 1 else "", pinned_versions=["v1"],
                          traffic_steps=[100])
            inp.origin, inp.step_wait_s = origin, 0.0
            handle = await start_rollout(s.client, inp)
            try:
                result = await asyncio.wait_for(handle.result(), 60)
            except asyncio.TimeoutError:
                raise AssertionError(f"v{i} did not finish: {await handle.query(RolloutWorkflow.status)}") from None
            assert result["ready"] == ["a"]
            async with PeerdClient(s.stack.peerd["a"].addr, s.stack.token) as c:
                kept = sorted(v["version"] for v in (await c.status())["stored"])
            assert kept == sorted({"v1", f"v{i - 1}" if i > 1 else "v1", f"v{i}"}), (i, kept)
            assert {v for _, v in s.servers["a"].versions} <= {f"v{i - 1}", f"v{i}"}
            sizes.append(disk_bytes(store))
            shutil.rmtree(src)
        one = m.total_size
        assert max(sizes) <= 3 * one + (1 << 20), sizes      # three versions at most, never ten
        print("store bytes after each rollout:", sizes)
    finally:
        await s.stop()
