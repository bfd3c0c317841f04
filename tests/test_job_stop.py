"""A stop (a paused or aborted rollout) reaches a download whatever its swarm loop is doing, even when
it lands in the same turn of the event loop as the wake-up the loop was waiting for: Python 3.11's
``asyncio.wait_for`` returns the finished wait there and drops the cancel that came with it, and a
dropped stop lets the download run on to the end."""
import asyncio

from peerd import manifest as mf
from peerd.config import PeerdConfig
from peerd.daemon import Daemon
from tests.waiting import until
from weightcast.checkpoint_random import write_random_checkpoint


async def test_a_stop_that_lands_as_the_swarm_loop_wakes_still_stops_the_download(tmp_path, keys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", 256 * 1024, files=1, seed=1)
    m = mf.build_from_directory(ckpt, "tiny", "v1", chunk_size=64 * 1024)
    body = {"manifest": mf.sign_manifest(m, keys["private"]), "origin": None, "peers": [], "pinned": False,
            "seeders": ["x"], "adopt": False}
    d = Daemon(PeerdConfig(host_id="x", store=tmp_path / "store", port=0, trusted_keys=[keys["pub_path"]]))
    await d.start()
    try:
        for turns in range(4):             # how many turns of the loop pass between the wake-up and the stop
            job = await d.submit(body)     # no source holds a chunk: the job waits in its swarm loop
            await until(lambda: job.policy is not None, 10, "the swarm loop running")
            await asyncio.sleep(0.05)
            job._wake.set()
            for _ in range(turns):
                await asyncio.sleep(0)
            job.stop("paused")
            done, _ = await asyncio.wait([job.task], timeout=5)
            assert done and job.state == "stopped", (turns, job.state)
            assert job.error == {"code": "stopped", "message": "paused"}
    finally:
        await d.stop()
