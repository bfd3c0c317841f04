"""Durable training through Temporal: the real dev server, the control worker, host workers as real
processes and rank processes they supervise. A rank killed mid-run, and a host worker killed mid-run
(its rank migrates to a spare), both recover from the newest complete checkpoint and end with the same
loss as an uninterrupted run; the finished weights are exported for the model server."""
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from serving.checkpoint import SMOKE
from serving.model import init_model
from training.config import TrainConfig
from training.launch import launch
from training.rank import held_out_loss
from lib.ports import free_ports
from weightcast.stack.temporal import SEARCH_ATTRIBUTES, temporal_binary
from workers import control_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput
from workflows.types import CONTROL_QUEUE
from tests.training_fixtures import CONFIG, hosts, progress
from tests.waiting import until

# host workers fork their rank fork servers from the run's zygote (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rank_zygote")


def plain_loss(out: Path, overrides=()) -> float:
    """The held-out loss of the same run's final weights, trained in one go by `weightcast train run`."""
    cfg = TrainConfig.load(None, [*CONFIG, *overrides])
    launch(cfg, out)
    model = init_model(cfg.model, cfg.seed)
    model.load_state_dict(torch.load(out / "model.pt"))
    return held_out_loss(model, cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return plain_loss(tmp_path_factory.mktemp("plain") / "run")


async def run_training(tmp_path, keys, temporal, fault, overrides=()):
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, ["t0", "t1", "t2"], spares=["t2"])
        try:
            run = uuid.uuid4().hex[:6]
            inp = TrainingInput(run=run, config=TrainConfig.load(None, [*CONFIG, *overrides]).to_dict(),
                                hosts=["t0", "t1", "t2"],
                                checkpoint_dir=str(tmp_path / "shared" / "ckpt"), checkpoint_every=5,
                                export_dir=str(tmp_path / "export"), heartbeat_timeout_s=4.0,
                                collective_timeout_s=20.0)
            async with control_worker.build(env.client, [keys["pub_path"]]):
                handle = await env.client.start_workflow(TrainingWorkflow.run, inp, id=f"train-{run}",
                                                         task_queue=CONTROL_QUEUE)
                await fault(procs)
                result = await asyncio.wait_for(handle.result(), 180)
                st = await handle.query(TrainingWorkflow.status)
                if os.environ.get("WEIGHTCAST_RECORD_HISTORIES"):      # a golden history with a recovery
                    hist = await handle.fetch_history()
                    (Path(__file__).parent / "histories" / f"{handle.id}.json").write_text(hist.to_json())
            return result, st
        finally:
            for p in procs.values():
                p.stop()


async def test_a_killed_rank_restarts_from_the_newest_checkpoint_with_the_same_loss(tmp_path, keys, uninterrupted,
                                                                                   temporal):
    async def kill_rank(procs):
        await until(lambda: progress(tmp_path, "t1", 1).get("step", 0) >= 17)
        os.kill(progress(tmp_path, "t1", 1)["pid"], signal.SIGKILL)

    result, st = await run_training(tmp_path, keys, temporal, kill_rank)
    assert len(result.recoveries) == 1
    rec = result.recoveries[0]
    assert rec.rank == 1 and rec.host == "t1" and rec.action == "restart on t1" and "was killed by SIGKILL" in rec.reason
    assert st.phase == "done" and st.ranks == ["t0", "t1"] and st.attempt == 1
    # resumed from a complete checkpoint (15, or 10 if 15's save was still in flight), not from step 0
    resumed = progress(tmp_path, "t0", 0)["first_step"]
    assert resumed in (10, 15)
    # the data order is a function of the step: the loss is the uninterrupted run's (fp32 reduction order)
    assert result.steps == 40
    assert result.final_loss == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)
    smoke = json.loads((tmp_path / "export" / SMOKE).read_text())
    assert smoke["version"] == result.run and len(smoke["expected"]) == 2


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
async def test_sharded_layouts_recover_from_their_sharded_checkpoints(tmp_path, keys, layout, temporal):
    """FSDP shards parameters and optimiser state, TP splits the weights: both save shards and resume
    from them, ending where the uninterrupted run of the same layout ends."""
    async def kill_rank(procs):
        await until(lambda: progress(tmp_path, "t1", 1).get("step", 0) >= 17)
        os.kill(progress(tmp_path, "t1", 1)["pid"], signal.SIGKILL)

    result, st = await run_training(tmp_path, keys, temporal, kill_rank, [f"layout={layout}"])
    assert [r.action for r in result.recoveries] == ["restart on t1"] and result.steps == 40
    assert progress(tmp_path, "t0", 0)["first_step"] in (10, 15)
    assert result.final_loss == pytest.approx(plain_loss(tmp_path / "plain", [f"layout={layout}"]), rel=1e-5, abs=1e-6)
    assert json.loads((tmp_path / "export" / SMOKE).read_text())["version"] == result.run   # exported whole


async def test_a_silent_host_loses_its_rank_to_a_spare(tmp_path, keys, uninterrupted, temporal):
    async def kill_host_worker(procs):
        await until(lambda: progress(tmp_path, "t1", 1).get("step", 0) >= 12)
        assert not spare_fork_server.exists()   # a spare imports torch only once it is given a rank
        procs["t1"].proc.kill()                 # the host worker: its rank's heartbeats stop

    spare_fork_server = tmp_path / "t2" / "train" / "fork-server.log"
    result, st = await run_training(tmp_path, keys, temporal, kill_host_worker)
    assert spare_fork_server.exists()           # started for the migrated rank
    assert [r.action for r in result.recoveries][:1] == ["migrate to t2"]
    assert "heartbeat" in result.recoveries[0].reason
    assert st.ranks == ["t0", "t2"] and st.spares == []
    # the orphaned rank kept training while its host was silent; the new attempt resumed on the spare
    # from the newest complete checkpoint
    moved = progress(tmp_path, "t2", 1)
    assert moved["step"] == 40 and moved["first_step"] >= 15
    assert result.final_loss == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


async def test_a_config_that_cannot_be_placed_is_refused_before_anything_starts(tmp_path, keys, temporal):
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        inp = TrainingInput(run="x", config=TrainConfig.load(None, [*CONFIG, "world_size=4"]).to_dict(),
                            hosts=["t0", "t1"], checkpoint_dir=str(tmp_path / "ckpt"))
        async with control_worker.build(env.client, [keys["pub_path"]]):
            handle = await env.client.start_workflow(TrainingWorkflow.run, inp, id="train-x", task_queue=CONTROL_QUEUE)
            with pytest.raises(WorkflowFailureError) as e:
                await handle.result()
    assert "needs 4 ranks but only 2 hosts" in str(e.value.cause)
    assert not (tmp_path / "ckpt").exists()


async def test_pause_checkpoint_now_resume_and_abort(tmp_path, keys, temporal):
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, ["t0", "t1"])
        try:
            cfg = TrainConfig.load(None, [*CONFIG, "steps=400"]).to_dict()
            ckpt = tmp_path / "shared" / "ckpt"
            async with control_worker.build(env.client, [keys["pub_path"]]):
                h = await env.client.start_workflow(TrainingWorkflow.run, TrainingInput(
                    run="ctl", config=cfg, hosts=["t0", "t1"], checkpoint_dir=str(ckpt), checkpoint_every=1000),
                    id="train-ctl", task_queue=CONTROL_QUEUE)
                await until(lambda: progress(tmp_path, "t0", 0).get("step", 0) >= 5)
                # checkpoint now: a complete checkpoint appears although none is due for 1,000 steps
                await h.execute_update(TrainingWorkflow.checkpoint_now, "test: before a risky change")
                await until(lambda: any((p / "complete.json").exists() for p in ckpt.glob("step-*")))
                # pause: every rank stops at one step boundary with that step checkpointed
                await h.execute_update(TrainingWorkflow.pause, "test: maintenance")
                for _ in range(600):
                    st = await h.query(TrainingWorkflow.status)
                    if st.phase == "paused":
                        break
                    await asyncio.sleep(0.05)
                assert st.phase == "paused" and st.recoveries == []
                stopped = progress(tmp_path, "t0", 0)["step"]
                assert 5 < stopped < 400
                assert (ckpt / f"step-{stopped:08d}" / "complete.json").exists()
                await asyncio.sleep(1.0)
                assert progress(tmp_path, "t0", 0)["step"] == stopped          # nothing runs while paused
                await h.execute_update(TrainingWorkflow.resume, "test: done")
                await until(lambda: progress(tmp_path, "t0", 0).get("first_step") == stopped
                            and progress(tmp_path, "t0", 0).get("step", 0) > stopped + 3)
                # abort: the ranks are stopped and the workflow ends, saying why
                await h.execute_update(TrainingWorkflow.abort, "test: wrong data")
                with pytest.raises(WorkflowFailureError) as e:
                    await h.result()
                assert "aborted: test: wrong data" in str(e.value.cause)
                st = await h.query(TrainingWorkflow.status)
                assert st.phase == "aborted" and st.recoveries == []
            await asyncio.sleep(1.0)
            last = progress(tmp_path, "t0", 0)["step"]
            await asyncio.sleep(1.0)
            assert progress(tmp_path, "t0", 0)["step"] == last < 400              # the rank processes are gone
        finally:
            for p in procs.values():
                p.stop()


async def cli(*args) -> tuple[int, str]:
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "weightcast.cli", *args,
                                             stdout=asyncio.subprocess.PIPE)
    out, _ = await p.communicate()
    return p.returncode, out.decode()


async def test_the_cli_starts_watches_and_reports_a_run(tmp_path, keys, capsys, temporal):
    from weightcast.cli import main
    # refused before connecting anywhere (no Temporal at this address)
    assert main(["train", "start", "--run", "r", "--hosts", "t0", "--checkpoint-dir", str(tmp_path / "c"),
                 "--temporal", "127.0.0.1:1", *[f"--set={c}" for c in CONFIG]]) == 2
    assert "needs 2 ranks but only 1 hosts" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="hosts file .*missing.txt not found"):
        main(["train", "start", "--run", "r", "--hosts", str(tmp_path / "missing.txt"), "--checkpoint-dir",
              str(tmp_path / "c"), "--temporal", "127.0.0.1:1", *[f"--set={c}" for c in CONFIG]])
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        ports = dict(zip(("t0", "t1"), free_ports(2)))
        procs = await hosts(env, tmp_path, ["t0", "t1"], metrics=ports)
        where = ["--temporal", env.client.service_client.config.target_host, "--namespace", env.client.namespace]
        try:
            async with control_worker.build(env.client, [keys["pub_path"]]):
                # the hosts from a file; checkpoints by time only (never by steps in a 40-step run)
                (tmp_path / "hosts.txt").write_text("# rank hosts, then spares\nt0\nt1\n")
                rc, out = await cli("train", "start", "--run", "cli", "--hosts", str(tmp_path / "hosts.txt"),
                                    "--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "1000",
                                    "--checkpoint-every-s", "0.05", "--export", str(tmp_path / "out"),
                                    "--wait", *where, *[f"--set={c}" for c in CONFIG])
                assert rc == 0
                saved = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "c").glob("step-*"))
                assert saved[-1] == 40 and len(saved) > 1, saved     # the final one and ones due by time
                final = json.loads(out.strip().splitlines()[-1])
                assert final["status"] == "COMPLETED" and final["phase"] == "done" and final["final_loss"] > 0
                for name in ("cli", "train-cli"):        # the run name, or the workflow id `start` printed
                    rc, out = await cli("train", "status", name, *where)
                    assert rc == 0
                    st = json.loads(out)
                    assert st["phase"] == "done" and st["ranks"] == ["t0", "t1"] and st["total_steps"] == 40
                p = await asyncio.create_subprocess_exec(sys.executable, "-m", "weightcast.cli", "train", "status",
                                                         "train-nope", *where,
                                                         stderr=asyncio.subprocess.PIPE)
                _, err = await p.communicate()
                assert p.returncode == 2 and "no training run 'train-nope'" in err.decode()   # not a traceback
                assert "Traceback" not in err.decode()
                assert (tmp_path / "out" / SMOKE).exists()
                # each host's Prometheus metrics: its rank's last step, speed and the final held-out loss
                for rank, host in enumerate(("t0", "t1")):
                    async with aiohttp.ClientSession() as s:
                        async with s.get(f"http://127.0.0.1:{ports[host]}/metrics") as r:
                            text = await r.text()
                    got = {m.group(1): float(m.group(2)) for m in re.finditer(
                        r'^weightcast_train_(\w+)\{rank="%d",run="cli"\} (\S+)$' % rank, text, re.M)}
                    assert got["step"] == 40 and got["tokens_per_second"] > 0 and 0 < got["mfu"] < 1, got
                    assert got["eval_loss"] == pytest.approx(final["final_loss"], abs=1e-4)
        finally:
            for p in procs.values():
                p.stop()


async def test_ranks_train_on_while_the_temporal_server_is_down(tmp_path, keys):
    from lib.ports import free_ports
    port = free_ports(1)[0]

    async def server():
        return await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_binary(), port=port, search_attributes=SEARCH_ATTRIBUTES,
            dev_server_database_filename=str(tmp_path / "temporal.db"))
    env = await server()
    procs = await hosts(env, tmp_path, ["t0", "t1"])
    try:
        async with control_worker.build(env.client, [keys["pub_path"]]):
            h = await env.client.start_workflow(TrainingWorkflow.run, TrainingInput(
                run="outage", config=TrainConfig.load(None, [*CONFIG, "steps=200"]).to_dict(), hosts=["t0", "t1"],
                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=20, heartbeat_timeout_s=10),
                id="train-outage", task_queue=CONTROL_QUEUE)
            await until(lambda: progress(tmp_path, "t0", 0).get("step", 0) >= 20)
            await env.shutdown()
            down = progress(tmp_path, "t0", 0)["step"]
            await asyncio.sleep(3.0)
            assert progress(tmp_path, "t0", 0)["step"] > down + 5        # no coordinator needed per step
            env = await server()
            result = await asyncio.wait_for(h.result(), 120)
        assert result.steps == 200 and result.recoveries == []         # caught up; nothing to recover
    finally:
        for p in procs.values():
            p.stop()
        await env.shutdown()


async def test_a_corrupt_or_partial_checkpoint_is_refused_and_the_previous_one_used(tmp_path, keys, uninterrupted,
                                                                                   temporal):
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, ["t0", "t1"])
        try:
            ckpt = tmp_path / "shared" / "ckpt"
            async with control_worker.build(env.client, [keys["pub_path"]]):
                h = await env.client.start_workflow(TrainingWorkflow.run, TrainingInput(
                    run="bad", config=TrainConfig.load(None, CONFIG).to_dict(), hosts=["t0", "t1"],
                    checkpoint_dir=str(ckpt), checkpoint_every=5), id="train-bad", task_queue=CONTROL_QUEUE)
                await until(lambda: progress(tmp_path, "t0", 0).get("step", 0) >= 12)
                await h.execute_update(TrainingWorkflow.pause, "test: corrupt the newest checkpoint")
                await until(lambda: progress(tmp_path, "t0", 0).get("first_step") is not None
                            and (ckpt / f"step-{progress(tmp_path, 't0', 0)['step']:08d}" / "complete.json").exists())
                for _ in range(600):
                    if (await h.query(TrainingWorkflow.status)).phase == "paused":
                        break
                    await asyncio.sleep(0.05)
                stopped = progress(tmp_path, "t0", 0)["step"]
                newest = ckpt / f"step-{stopped:08d}"
                shard = max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0xFF                     # same size, one bit pattern changed
                shard.write_bytes(bytes(data))
                partial = ckpt / f"step-{stopped + 1:08d}"       # a save that never finished: no marks
                partial.mkdir()
                (partial / "__0_0.distcp").write_bytes(b"\0" * 1024)
                previous = max(int(p.name[5:]) for p in ckpt.glob("step-*") if int(p.name[5:]) < stopped
                               and (p / "complete.json").exists())
                await h.execute_update(TrainingWorkflow.resume, "test: resume")
                result = await asyncio.wait_for(h.result(), 180)
                st = await h.query(TrainingWorkflow.status)
        finally:
            for p in procs.values():
                p.stop()
    # the corrupt and the partial checkpoint were refused; training went on from the one before
    assert st.resumed_from == [0, previous] and result.recoveries == []
    # the ranks split the hashing: the one that hashed the bad shard names it, the other defers to it
    logs = [next((tmp_path / h / "train" / "bad").glob(f"attempt-1/rank{r}/rank.log")).read_text()
            for r, h in enumerate(["t0", "t1"])]
    assert any(f"step-{stopped:08d} refused (files changed or missing since the save: {shard.name})" in log
               for log in logs)
    assert all(f"step-{stopped:08d} refused" in log and f"step-{stopped + 1:08d} refused (not marked complete" in log
               for log in logs)
    assert result.steps == 40
    assert result.final_loss == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


def test_bench_train_recovery_reports_both_recoveries_side_by_side(capsys):
    from weightcast.cli import main
    rc = main(["bench", "train-recovery", "--ranks", "2", "--steps", "16", "--kill-at", "9", "--every", "4",
               "--set", "model.d_model=64", "--set", "model.d_ff=128", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    for who in ("workflow", "torchrun"):
        # both resumed from the checkpoint at 8 (or 4 if 8's save was still in flight), same final weights
        assert r[who]["killed_at_step"] >= 9 and r[who]["resumed_from_step"] in (4, 8) and r[who]["final_loss_matches"]
        assert r[who]["recovery_s"] > 0
    assert r["recovery_over_torchrun"] > 0
    parts = r["workflow"]["breakdown_s"]
    assert set(parts) == {"failure_recorded", "next_attempt_started", "rank_spec_read", "group_formed",
                          "checkpoint_loaded", "first_step"}
    assert sum(parts.values()) == pytest.approx(r["workflow"]["recovery_s"], abs=0.3)
    assert 0 < r["save_stall_s"]["async_median"] and 0 < r["save_stall_s"]["sync_median"]
    shutil.rmtree(r["workdir"])                 # the bench keeps its runs' logs and checkpoints for its reader


@pytest.mark.parametrize("min_world_size", [0, 1], ids=["waits-for-its-host", "shrinks"])
async def test_a_lost_host_without_a_spare(tmp_path, keys, uninterrupted, min_world_size, temporal):
    """No spare left: by default the rank waits for its host to return and restarts there; with
    min_world_size the run goes on with fewer data-parallel ranks. Either way the training is the same."""
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, ["t0", "t1"])
        try:
            inp = TrainingInput(run="nospare", config=TrainConfig.load(None, CONFIG).to_dict(), hosts=["t0", "t1"],
                                checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5, heartbeat_timeout_s=4.0,
                                collective_timeout_s=20.0, min_world_size=min_world_size)
            async with control_worker.build(env.client, [keys["pub_path"]]):
                h = await env.client.start_workflow(TrainingWorkflow.run, inp, id="train-nospare",
                                                    task_queue=CONTROL_QUEUE)
                await until(lambda: progress(tmp_path, "t1", 1).get("step", 0) >= 12)
                procs["t1"].proc.kill()
                if not min_world_size:
                    await asyncio.sleep(6.0)         # past the 4 s heartbeat timeout: recovered "on t1"
                    await asyncio.to_thread(procs["t1"].start)
                result = await asyncio.wait_for(h.result(), 180)
                st = await h.query(TrainingWorkflow.status)
        finally:
            for p in procs.values():
                p.stop()
    if min_world_size:
        assert [r.action for r in result.recoveries][:1] == ["shrink to 1 rank"] and st.ranks == ["t0"]
        # one rank now takes the whole global batch: the same samples per step
        assert progress(tmp_path, "t0", 0)["first_step"] >= 10
    else:
        assert [r.action for r in result.recoveries][:1] == ["restart on t1"] and st.ranks == ["t0", "t1"]
    assert result.steps == 40
    assert result.final_loss == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)


def test_shrinking_keeps_the_global_batch_divisible():
    from workflows.training import TrainingWorkflow as W
    inp = TrainingInput(run="x", config={"global_batch": 16, "layout": "ddp"}, hosts=[], checkpoint_dir="",
                        min_world_size=2)
    assert W._shrunk(inp, ["a", "b", "c", "d"], 1) == (["a", "c"], ["d"])      # 3 does not divide 16: 2, d spare
    assert W._shrunk(inp, ["a", "b"], 0) is None                             # 1 is below the minimum
    assert W._shrunk(TrainingInput(**{**inp.__dict__, "min_world_size": 0}), ["a", "b", "c"], 0) is None


async def test_a_lost_checkpoint_volume_is_restored_from_the_archive(tmp_path, keys, seaweed, temporal):
    """The shared checkpoint volume is lost while the ranks write to it, and a rank dies with it: the
    recovery restores the newest archived checkpoint. A pause first makes sure the archive holds one
    (on a busy machine the archive once lagged the run by 950 steps); the fault comes right after."""
    steps = 400
    from peerd.origin import OriginSpec, S3Origin
    from training.archive import newest_archived
    from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
    where = {"endpoint": seaweed.endpoint, "bucket": seaweed.bucket, "prefix": f"ckpt/{uuid.uuid4().hex[:8]}"}

    async def archived() -> int:
        async with S3Origin(OriginSpec(**where), ACCESS_KEY, SECRET_KEY) as o:
            return await newest_archived(o) or 0

    async def paused() -> bool:
        return (await h.query(TrainingWorkflow.status)).phase == "paused"

    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        procs = await hosts(env, tmp_path, ["t0", "t1"], seaweed.env())
        ckpt = tmp_path / "shared" / "ckpt"
        try:
            inp = TrainingInput(run="vol", config=TrainConfig.load(None, [*CONFIG, f"steps={steps}"]).to_dict(),
                                hosts=["t0", "t1"], checkpoint_dir=str(ckpt), checkpoint_every=5,
                                heartbeat_timeout_s=4.0, collective_timeout_s=20.0, checkpoint_archive=where)
            async with control_worker.build(env.client, [keys["pub_path"]]):
                h = await env.client.start_workflow(TrainingWorkflow.run, inp, id="train-vol", task_queue=CONTROL_QUEUE)
                await until(lambda: progress(tmp_path, "t0", 0).get("step", 0) >= 10, 120, "ten steps")
                await h.execute_update(TrainingWorkflow.pause, "test: archive before the fault")
                await until(paused, 60, "the run paused")
                stopped = progress(tmp_path, "t0", 0)["step"]
                in_archive = await archived()
                assert in_archive == stopped             # a paused run's last checkpoint is archived
                await h.execute_update(TrainingWorkflow.resume, "test: go on")
                await until(lambda: progress(tmp_path, "t1", 1).get("first_step") == stopped
                            and progress(tmp_path, "t1", 1).get("step", 0) > stopped + 2, 60, "the ranks running again")
                assert progress(tmp_path, "t1", 1)["step"] < steps - 100, "the run nearly ended before the fault"
                os.replace(ckpt, tmp_path / "lost")      # the volume is lost (at once: ranks are writing)...
                with contextlib.suppress(ProcessLookupError):   # ...and a rank with it (if the loss did not end it)
                    os.kill(progress(tmp_path, "t1", 1)["pid"], signal.SIGKILL)
                result = await asyncio.wait_for(h.result(), 240)
        finally:
            for p in procs.values():
                p.stop()
    assert len(result.recoveries) >= 1 and result.steps == steps
    assert progress(tmp_path, "t0", 0)["first_step"] >= in_archive        # restored, not started over
    assert await archived() == steps                                    # the final state is archived too
