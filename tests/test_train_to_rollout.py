"""Train → export → publish → roll out as one durable chain (TrainingWorkflow with a child
RolloutWorkflow), on the embedded stack: the real dev server, SeaweedFS, peerd, host workers (which
both train and load), model servers, the router, and a publish worker holding the signing key."""
import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from temporalio.client import WorkflowFailureError

from peerd.signing import generate_keypair
from serving.model import init_model
from tests.training_fixtures import CONFIG, progress
from tests.waiting import until
from training.config import TrainConfig
from training.export import read_export
from weightcast.stack.embedded import EmbeddedStack
from weightcast.training_runs import start_training
from workers import publish_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput
from workflows.types import RolloutInput

# host workers fork their rank fork servers from the run's zygote (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rank_zygote")

HOSTS = ["h0", "h1", "h2"]


def chain_input(tmp: Path, stack: EmbeddedStack, seaweed, run: str, **kw) -> TrainingInput:
    cfg = TrainConfig.load(None, [*CONFIG, "steps=60"]).to_dict()
    rollout = RolloutInput("tiny", f"v-{run}", "", {"endpoint": seaweed.endpoint, "bucket": seaweed.bucket,
                                                     "prefix": f"train/{uuid.uuid4().hex[:8]}"},
                           hosts=list(stack.hosts), router=stack.router_addr, step_wait_s=0.2)
    return TrainingInput(run=run, config=cfg, hosts=["h0", "h1"], checkpoint_dir=str(tmp / "shared" / "ckpt"),
                         checkpoint_every=5, export_dir=str(tmp / "shared" / "export"), heartbeat_timeout_s=4.0,
                         collective_timeout_s=20.0, rollout=rollout, publish_chunk_size=64 * 1024, **kw)


async def test_trained_weights_roll_out_through_one_durable_chain(tmp_path, seaweed, keys, temporal):
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], HOSTS, s3=seaweed,
                                **temporal.stack_args()).start()
    creds = seaweed.env()
    try:
        async with publish_worker.build(stack.client, keys["priv_path"],
                                        (creds["AWS_ACCESS_KEY_ID"], creds["AWS_SECRET_ACCESS_KEY"])):
            inp = chain_input(tmp_path, stack, seaweed, "chain-golden")
            h = await start_training(stack.client, inp)
            # a rank dies mid-run: the chain recovers it and goes on
            await until(lambda: progress(tmp_path / "stack", "h1", 1).get("step", 0) >= 8, 120)
            os.kill(progress(tmp_path / "stack", "h1", 1)["pid"], signal.SIGKILL)
            result = await asyncio.wait_for(h.result(), 240)
            st = await h.query(TrainingWorkflow.status)
            if os.environ.get("WEIGHTCAST_RECORD_HISTORIES"):
                (Path(__file__).parent / "histories" / f"{h.id}.json").write_text((await h.fetch_history()).to_json())
        assert result.steps == 60 and len(result.recoveries) == 1 and st.phase == "done"
        assert result.rollout_id == "rollout-tiny-v-chain-golden" and sorted(result.rollout_ready) == HOSTS
        rollout = await stack.client.get_workflow_handle(result.rollout_id).describe()
        assert rollout.status.name == "COMPLETED" and rollout.parent_id == h.id     # the chain, in Temporal
        assert len(result.version_id) == 64
        # every host now answers with the trained weights: the export's, not the initial ones
        cfg = TrainConfig.from_dict(inp.config)
        trained = read_export(Path(inp.export_dir), cfg.model)
        ids = [[1, 2, 3, 4, 5]]
        with torch.no_grad():
            want = trained(torch.tensor(ids))[:, -1, :16]
            initial = init_model(cfg.model, cfg.seed)(torch.tensor(ids))[:, -1, :16]
        assert not torch.allclose(want, initial, atol=1e-3)
        async with aiohttp.ClientSession() as s:
            for _ in range(6):          # several requests: the router spreads them over the hosts
                async with s.post(f"{stack.router_addr}/v1/models/tiny/infer", json={"input_ids": ids}) as r:
                    answer = await r.json()
                assert r.status == 200 and answer["model_version"] == "v-chain-golden"
                assert torch.allclose(torch.tensor(answer["logits_head"]), want, atol=1e-4)
    finally:
        await stack.stop()


async def test_a_rollout_that_would_be_refused_stops_training_before_any_rank_starts(tmp_path, seaweed, keys, temporal):
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], HOSTS[:2], s3=seaweed,
                                **temporal.stack_args()).start()
    generate_keypair(tmp_path / "other.pem", tmp_path / "other.pub")       # a key the fleet does not trust
    try:
        async with publish_worker.build(stack.client, tmp_path / "other.pem"):
            inp = chain_input(tmp_path, stack, seaweed, "untrusted")
            h = await start_training(stack.client, inp)
            with pytest.raises(WorkflowFailureError) as e:
                await asyncio.wait_for(h.result(), 60)
        msg = str(e.value.cause)
        assert "could not be rolled out, so training was not started" in msg and "does not trust the signing key" in msg, msg
        assert (await h.query(TrainingWorkflow.status)).phase == "failed"
        assert not (tmp_path / "shared").exists()          # no rank ran, no checkpoint was written
        assert not list((tmp_path / "stack").glob("h*/train/untrusted"))
    finally:
        await stack.stop()


def test_train_start_refuses_a_rollout_it_could_not_do_before_connecting(tmp_path, capsys):
    from weightcast.cli import main
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps([{"id": "h0", "model_server": "http://127.0.0.1:8100"}, {"id": "h1"}]))
    base = ["train", "start", "--run", "r", "--hosts", "t0,t1", "--checkpoint-dir", str(tmp_path / "c"),
            "--temporal", "127.0.0.1:1", *[f"--set={c}" for c in CONFIG],
            "--model", "m", "--bucket", "b", "--endpoint", "http://127.0.0.1:1"]
    assert main([*base, "--roll-out", str(fleet)]) == 2
    assert "needs the exported weights: give export_dir (--export DIR)" in capsys.readouterr().err
    assert main([*base, "--roll-out", str(fleet), "--export", str(tmp_path / "e"), "--router", "http://r"]) == 2
    assert "with a router every host needs its model_server address" in capsys.readouterr().err
    fleet.write_text("{not json")
    assert main([*base, "--roll-out", str(fleet), "--export", str(tmp_path / "e")]) == 2
    assert "not a host list" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--roll-out needs --model"):
        main([a for a in base if a not in ("--model", "m")] + ["--roll-out", str(fleet)])
    assert not (tmp_path / "c").exists()
