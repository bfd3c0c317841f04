"""The demo's training prologue: a durable run (TrainingWorkflow) on two of the embedded stack's hosts,
one rank killed with SIGKILL mid-run and recovered from the newest complete checkpoint, its weights
exported, then published by the publish worker and rolled out by the chain's child RolloutWorkflow."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from temporalio.client import WorkflowFailureError

from serving.model import ModelConfig, TinyTransformer
from training.config import TrainConfig
from training.export import read_export
from weightcast.stack.embedded import EmbeddedStack
from weightcast.training_runs import start_training, training_id
from workers import publish_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput
from workflows.types import RolloutInput

RANK_HOSTS = ["h0", "h1"]           # rank 0 and rank 1; rank 1 is the one killed


class PrologueFailed(RuntimeError):
    """The training run ended without handing its weights to a rollout; the message says how."""


@dataclass
class Trained:
    rollout_id: str                  # the child RolloutWorkflow, already started
    version_id: str
    bytes: int                       # the exported checkpoint's size (what the swarm moves to each host)
    model: TinyTransformer           # the exported weights: what every host must answer with
    report: dict = field(default_factory=dict)


async def train_then_roll_out(stack: EmbeddedStack, work: Path, signing_key: Path, model: str, version: str,
                              mcfg: ModelConfig, steps: int, rollout: dict, say: Callable[[str], None]) -> Trained:
    """Train, kill rank 1 halfway, and return once the chain has started the rollout of the export."""
    s3 = stack.s3.env()
    cfg = TrainConfig(model=mcfg, layout="ddp", world_size=2, global_batch=8, seq_len=min(32, mcfg.max_seq),
                      steps=steps, lr=3e-3)
    run = f"demo-{version}"
    inp = TrainingInput(
        run=run, config=cfg.to_dict(), hosts=RANK_HOSTS, checkpoint_dir=str(work / "train" / "checkpoints"),
        checkpoint_every=max(1, steps // 4), export_dir=str(work / "train" / "export"), heartbeat_timeout_s=10.0,
        collective_timeout_s=30.0, publish_chunk_size=1 << 20,
        rollout=RolloutInput(model, version, "", {"endpoint": stack.s3.endpoint, "bucket": stack.s3.bucket,
                                                  "prefix": f"{model}/{version}"}, list(stack.hosts), **rollout))
    # the publish worker (the signing key's holder) is needed until the export is published
    async with publish_worker.build(stack.client, signing_key, (s3["AWS_ACCESS_KEY_ID"], s3["AWS_SECRET_ACCESS_KEY"])):
        return await _train(stack, inp, cfg, say)


async def _train(stack: EmbeddedStack, inp: TrainingInput, cfg: TrainConfig, say: Callable[[str], None]) -> Trained:
    run, steps = inp.run, cfg.steps
    t0 = time.monotonic()
    h = await start_training(stack.client, inp)
    say(f"training {run}: {cfg.world_size} DDP ranks on {', '.join(RANK_HOSTS)}, {steps} steps, async checkpoints "
        f"every {inp.checkpoint_every}; Temporal UI: {stack.ui_url(training_id(run))}")
    killed_at, last_said = None, -1
    while True:
        st = await h.query(TrainingWorkflow.status)
        p = _progress(stack.root, run)
        if killed_at is None and steps // 2 <= p.get("step", 0) < steps and st.phase == "running":
            try:
                os.kill(p["pid"], signal.SIGKILL)
                killed_at = p["step"]
                say(f"  step {killed_at}: killed rank 1 (pid {p['pid']}) with SIGKILL; the workflow recovers it")
            except ProcessLookupError:          # it finished between the read and the kill: nothing to show
                killed_at = -1
                say("  rank 1 finished before it could be killed; no recovery to show")
        elif p.get("loss") is not None and p["step"] != last_said and p["step"] % max(1, steps // 6) == 0:
            say(f"  step {p['step']}/{steps} loss {p['loss']:.3f} (checkpoint {p.get('last_checkpoint')})")
        last_said = p.get("step", last_said)
        if st.rollout_id or st.phase in ("failed", "aborted", "done"):
            break
        await asyncio.sleep(0.05)
    if not st.rollout_id:
        try:
            await h.result()
        except WorkflowFailureError as e:
            raise PrologueFailed(f"{h.id} failed: {e.cause or e}") from None
        raise PrologueFailed(f"{h.id} ended without starting a rollout ({st.phase}: {st.detail})")
    for r in st.recoveries:
        say(f"  recovery: rank {r.rank} on {r.host}: {r.reason}; {r.action}")
    say(f"trained {steps} steps in {time.monotonic() - t0:.1f} s (held-out loss {st.final_loss:.4f}); exported, "
        f"published as {st.version_id[:12]} and handed to {st.rollout_id}")
    export = Path(inp.export_dir)
    return Trained(st.rollout_id, st.version_id, sum(f.stat().st_size for f in export.iterdir() if f.is_file()),
                   read_export(export, cfg.model),
                   {"workflow_id": h.id, "steps": steps, "killed_rank_at_step": killed_at,
                    "recoveries": [f"rank {r.rank} on {r.host}: {r.reason}; {r.action}" for r in st.recoveries],
                    "resumed_from": st.resumed_from, "held_out_loss": st.final_loss,
                    "train_s": round(time.monotonic() - t0, 2)})


def _progress(root: Path, run: str) -> dict:
    """Rank 1's newest progress (step, loss, pid), as its host's train_rank activity reads it."""
    for f in sorted((root / RANK_HOSTS[1] / "train" / run).glob("attempt-*/rank1/progress.json"), reverse=True):
        try:
            return json.loads(f.read_text())
        except ValueError:
            pass
    return {}
