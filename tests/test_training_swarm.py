"""Node-local checkpoints (``--checkpoint-dir '.../{host}'``): each rank saves to its own host's disk,
every checkpoint is replicated to the ranks' hosts through peerd's swarm, and a replacement host gets
the newest one from its peers before its rank starts. Real dev server, host workers, rank processes
and peerds."""
import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from lib.atomic import write_atomic
from lib.ports import free_ports
from tests.fleet import TOKEN, Fleet
from tests.test_training_workflow import plain_loss
from tests.training_fixtures import CONFIG, hosts, progress
from tests.waiting import until
from training.checkpoint_files import CHUNK_SIZE, MARK, MERGED, check, mark_bytes, step_dir, write_digests
from training.checkpoint_swarm import CheckpointSwarm
from training.config import TrainConfig
from workers import control_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput
from workflows.types import CONTROL_QUEUE

# host workers fork their rank fork servers from the run's zygote (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rank_zygote")

HOSTS = ["s0", "s1", "s2"]
STEPS = 600             # ~8 s of training here: the fault lands mid-run


def complete_steps(root: Path, host: str) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (root / host / "ckpt").glob("step-*") if (p / MARK).is_file())


async def test_a_replacement_host_gets_the_checkpoint_from_its_peers(tmp_path, keys, seaweed, temporal):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], HOSTS).start()
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, HOSTS, fleet=fleet)
        try:
            run = uuid.uuid4().hex[:6]
            inp = TrainingInput(run=run, config=TrainConfig.load(None, [*CONFIG, f"steps={STEPS}"]).to_dict(), hosts=HOSTS,
                                checkpoint_dir=str(tmp_path / "{host}" / "ckpt"), checkpoint_every=50,
                                export_dir=str(tmp_path / "export"), heartbeat_timeout_s=4.0, collective_timeout_s=20.0)
            async with control_worker.build(env.client, [keys["pub_path"]]):
                handle = await env.client.start_workflow(TrainingWorkflow.run, inp, id=f"train-{run}",
                                                         task_queue=CONTROL_QUEUE)
                # a checkpoint whole on both ranks' hosts: each wrote half of it and got the rest by swarm
                await until(lambda: set(complete_steps(tmp_path, "s0")) & set(complete_steps(tmp_path, "s1")), 120)
                # then s1 is lost with its disk: host worker, rank, peerd
                at = progress(tmp_path, "s1", 1)
                assert at["step"] < STEPS - 50, f"the run was nearly over ({at['step']}) before the fault"
                rank1 = at["pid"]
                procs["s1"].proc.kill()
                os.kill(rank1, signal.SIGKILL)
                fleet.procs["s1"].kill()
                result = await asyncio.wait_for(handle.result(), 240)
                st = await handle.query(TrainingWorkflow.status)
        finally:
            for p in procs.values():
                p.stop()
            fleet.stop()
    assert [r.action for r in result.recoveries][:1] == ["migrate to s2"]
    moved = progress(tmp_path, "s2", 1)
    assert moved["step"] == STEPS and moved["first_step"] >= 50
    assert result.final_loss == pytest.approx(plain_loss(tmp_path / "plain", [f"steps={STEPS}"]), rel=1e-5, abs=1e-6)
    # s2 had no checkpoint of its own: the one it resumed from came from s0's peerd through the swarm
    # with no archive configured, the step it resumed from could only come from s0's peerd
    fetched = [f for f in st.fetched_checkpoints if f["host"] == "s2"]
    assert [f["step"] for f in fetched] == [moved["first_step"]] and fetched[0]["rank"] == 1
    assert fetched[0]["bytes_from_peers"] > 0 and fetched[0]["bytes_from_origin"] == 0
    # both ranks' hosts end with the final checkpoint whole, and the export came from it
    assert STEPS in complete_steps(tmp_path, "s0") and STEPS in complete_steps(tmp_path, "s2")
    assert (tmp_path / "export").is_dir()


async def test_a_host_whose_peerd_is_down_resumes_from_its_own_checkpoints(tmp_path, caplog):
    """No answer from this host's peerd: nothing fetched, said in the log, and the rank starts anyway
    (from whatever whole checkpoints this host has)."""
    swarm = CheckpointSwarm("r", tmp_path / "ckpt", f"http://127.0.0.1:{free_ports(1)[0]}", "t", tmp_path / "store")
    assert await swarm.restore_newest() is None
    assert "did not answer" in caplog.text and "own checkpoints" in caplog.text


async def test_a_step_whole_in_this_hosts_peerd_but_never_laid_out_is_laid_out_before_the_rank_starts(
        tmp_path, keys, seaweed, caplog):
    """The rank's activity ended (its peer died) after the host's peerd had the merged step whole but
    before the replication pass wrote the step's mark: a restarted host worker lays it out from its
    own peerd, so the rank resumes from that step and not from an older one."""
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["h"]).start()
    try:
        root = tmp_path / "ckpt"
        step = step_dir(root, 100)
        step.mkdir(parents=True)
        (step / "__0_0.distcp").write_bytes(os.urandom(300_000))
        (step / ".metadata").write_bytes(b"metadata")
        raw = write_digests(step, 0, 1, CHUNK_SIZE)
        write_atomic(step / MERGED, mark_bytes(100, [json.loads(raw)]))
        store = tmp_path / "h" / "store"
        first = CheckpointSwarm("r", root, fleet.procs["h"].addr, TOKEN, store)
        async with fleet.client("h") as c:
            m = await first.offer(c, step)                   # as a pass offers it: peerd verifies the files in place
            assert (await c.wait(m.digest, 30))["state"] == "complete"
        assert not (step / MARK).exists()                    # the worker went before its next pass

        got = await CheckpointSwarm("r", root, fleet.procs["h"].addr, TOKEN, store).restore_newest()
        assert got["step"] == 100 and got["version_id"] == m.digest
        assert got["bytes_from_peers"] == got["bytes_from_origin"] == 0
        assert "step-00000100 laid out from this host's own peerd" in caplog.text
        assert (step / MARK).is_file() and check(step) is None
    finally:
        fleet.stop()
