"""A host's store on a small real file system (a tmpfs of fixed size) that fills up in the middle of a
download: the host fails as ``disk_full``, and nothing else is lost (the version it already serves
stays stored, loaded and answering; its peerd stays up; the other host finishes)."""
import asyncio
import subprocess

import aiohttp
import pytest

from peerd.client import PeerdClient
from tests.rollout_fixtures import Stack
from tests.test_rollout_faults import RATE
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow

STORE_FS = 4 * 1024 * 1024       # room for the two ~0.6 MB versions with space to spare, before the filler


@pytest.fixture
def small_store(tmp_path):
    """Host a's peerd store on its own 4 MiB tmpfs, unmounted afterwards."""
    store = tmp_path / "stack" / "a" / "store"
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_FS}", "weightcast-test-store", str(store)], check=True)
    yield store
    subprocess.run(["umount", "-l", str(store)], check=True)


async def mid_download(s: Stack, host: str, version: str) -> None:
    for _ in range(1200):
        async with PeerdClient(s.stack.peerd[host].addr, s.stack.token) as c:
            st = await c.status()
        vids = {v["version_id"] for v in st["stored"] if v["version"] == version}
        jobs = [j for j in st["jobs"] if j["version_id"] in vids]
        if jobs and jobs[0]["chunks_done"] >= 1:
            assert jobs[0]["chunks_done"] < jobs[0]["chunks_total"], "too late: the host already has everything"
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{host} made no progress on {version}")


def fill(path) -> int:
    """Write a file until the file system is full; the bytes written."""
    n = 0
    with open(path / "filler", "wb") as f:
        try:
            while True:
                n += f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return n


async def test_a_store_filling_up_mid_download_fails_the_host_as_disk_full_and_loses_nothing(
        tmp_path, seaweed, keys, small_store, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal)
    try:
        v1 = await start_rollout(s.client, s.input(traffic_steps=[100]))
        assert (await v1.result())["ready"] == ["a", "b"]
        v2 = await s.publish("tiny", "v2", seed=9)
        handle = await start_rollout(s.client, s.input(**v2, previous_version="v1", traffic_steps=[100],
                                                       failure_budget=0.5))
        await mid_download(s, "a", "v2")
        assert fill(small_store) > 0                             # someone else fills the disk mid-download
        result = await asyncio.wait_for(handle.result(), 120)

        st = await handle.query(RolloutWorkflow.status)
        assert result["ready"] == ["b"] and st.hosts["a"] == "failed"
        assert "disk_full" in st.errors["a"], st.errors
        print("host a:", st.errors["a"])
        # nothing else lost on a: its peerd answers, v1 is still stored complete, loaded and serving
        async with PeerdClient(s.stack.peerd["a"].addr, s.stack.token) as c:
            stored = {v["version"]: v for v in (await c.status())["stored"]}
        assert stored["v1"]["complete"] and s.servers["a"].versions[("tiny", "v1")].state == "ready"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{s.router_addr}/v1/models/tiny/infer",
                                 json={"input_ids": [[1, 2]], "model_version": "v1"}) as r:
                assert r.status == 200
        assert "a" in s.stack.router.table.models["tiny"].ready_hosts("v1")
    finally:
        await s.stop()
