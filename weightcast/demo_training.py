"""The demo's training prologue: a small Llama (transformers' own) trained on real text, the installed
Python's standard-library sources with a tokenizer trained on them, as a durable run
(TrainingWorkflow) on two of the embedded stack's hosts; one rank killed with SIGKILL mid-run and
recovered from the newest complete checkpoint; its weights exported as a Hugging Face directory,
then published by the publish worker (golden prompts recorded) and rolled out by the chain's child
RolloutWorkflow to the hosts' engine (vLLM under `make demo`)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from temporalio.client import WorkflowFailureError

from serving.model_config import ModelConfig
from training.config import TrainConfig
from training.models import build
from training.rank import held_out_loss
from weightcast.stack.embedded import EmbeddedStack
from weightcast.training_runs import start_training, training_id
from workers import publish_worker
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput
from workflows.types import RolloutInput

RANK_HOSTS = ["h0", "h1"]           # rank 0 and rank 1; rank 1 is the one killed
# the serving tests' tiny Llama shape (head_dim 32: vLLM's CPU attention takes no smaller), GQA 2:1
LLAMA = ModelConfig(vocab=512, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq=256)
GREEDY_PROMPTS = ("import ", "def __init__(self", "    for ")


def llama_config(steps: int, cache: Path) -> TrainConfig:
    """What the prologue trains: two DDP ranks over every top-level module of the standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return TrainConfig(model=LLAMA, family="llama", kv_heads=1, layout="ddp", world_size=2, global_batch=16,
                       seq_len=64, steps=steps, lr=3e-3, warmup_steps=10, schedule="cosine", grad_clip=1.0,
                       data=f"{stdlib}/*.py", tokenizer="train", data_cache=str(cache)).check()


class PrologueFailed(RuntimeError):
    """The training run ended without handing its weights to a rollout; the message says how."""


@dataclass
class Trained:
    rollout_id: str                  # the child RolloutWorkflow, already started
    version_id: str
    export: Path                     # the Hugging Face directory the chain published
    report: dict = field(default_factory=dict)


async def train_then_roll_out(stack: EmbeddedStack, work: Path, signing_key: Path, model: str, version: str,
                              steps: int, hosts: list[str], rollout: dict, say: Callable[[str], None]) -> Trained:
    """Train, kill rank 1 halfway, and return once the chain has started the rollout of the export to
    ``hosts``."""
    s3 = stack.s3.env()
    cfg = llama_config(steps, work / "tokens")
    run = f"demo-{version}"
    inp = TrainingInput(
        run=run, config=cfg.to_dict(), hosts=RANK_HOSTS, checkpoint_dir=str(work / "train" / "checkpoints"),
        checkpoint_every=max(1, steps // 4), export_dir=str(work / "train" / "export"), heartbeat_timeout_s=10.0,
        collective_timeout_s=30.0, publish_chunk_size=1 << 20,
        rollout=RolloutInput(model, version, "", {"endpoint": stack.s3.endpoint, "bucket": stack.s3.bucket,
                                                  "prefix": f"{model}/{version}"}, hosts, **rollout))
    # the publish worker (the signing key's holder) is needed until the export is published
    async with publish_worker.build(stack.client, signing_key, (s3["AWS_ACCESS_KEY_ID"], s3["AWS_SECRET_ACCESS_KEY"])):
        return await _train(stack, inp, cfg, say)


async def _train(stack: EmbeddedStack, inp: TrainingInput, cfg: TrainConfig, say: Callable[[str], None]) -> Trained:
    run, steps = inp.run, cfg.steps
    t0 = time.monotonic()
    # the corpus tokenized once (the ranks read the cache) and the held-out loss of the untrained model
    start_loss = await asyncio.to_thread(lambda: held_out_loss(build(cfg), cfg, torch.device("cpu")))
    say(f"training {run}: a Llama ({cfg.model.n_layers} layers, d {cfg.model.d_model}, GQA "
        f"{cfg.model.n_heads}:{cfg.kv_heads}) on the standard library's sources, {cfg.world_size} DDP ranks on "
        f"{', '.join(RANK_HOSTS)}, {steps} steps, held-out loss {start_loss:.3f} before; Temporal UI: "
        f"{stack.ui_url(training_id(run))}")
    h = await start_training(stack.client, inp)
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
    say(f"trained {steps} steps in {time.monotonic() - t0:.1f} s: held-out loss {start_loss:.3f} -> "
        f"{st.final_loss:.3f}; exported as a Hugging Face directory, published as {st.version_id[:12]} (golden "
        f"prompts recorded) and handed to {st.rollout_id}")
    return Trained(st.rollout_id, st.version_id, Path(inp.export_dir),
                   {"workflow_id": h.id, "steps": steps, "killed_rank_at_step": killed_at,
                    "recoveries": [f"rank {r.rank} on {r.host}: {r.reason}; {r.action}" for r in st.recoveries],
                    "resumed_from": st.resumed_from, "held_out_loss_start": round(start_loss, 4),
                    "held_out_loss": st.final_loss, "train_s": round(time.monotonic() - t0, 2)})


def _progress(root: Path, run: str) -> dict:
    """Rank 1's newest progress (step, loss, pid), as its host's train_rank activity reads it."""
    for f in sorted((root / RANK_HOSTS[1] / "train" / run).glob("attempt-*/rank1/progress.json"), reverse=True):
        try:
            return json.loads(f.read_text())
        except ValueError:
            pass
    return {}


async def serve_and_ask(stack: EmbeddedStack, trained: Trained, model: str, say: Callable[[str], None]) -> dict:
    """Wait for the chain's rollout, then ask the served model like a user: the golden prompt (recorded
    again here from the export, as the publish worker did) and a few greedy completions."""
    from serving import golden
    from weightcast.demo_hf import ask_like_a_user
    t0 = time.monotonic()
    result = await stack.client.get_workflow_handle(trained.rollout_id).result()
    record = await asyncio.to_thread(golden.record, trained.export)
    answer = await ask_like_a_user(stack, trained.export, record, model, GREEDY_PROMPTS)
    for g in answer["greedy"]:
        say(f"  greedy: {g['prompt'] + g['text']!r}")
    return {"model": model, "engine": stack.engine, "workflow_id": trained.rollout_id, "hosts_ready": result["ready"],
            "rollout_s": round(time.monotonic() - t0, 1), **answer,
            "ok": answer["openai_completion"]["matches_golden"] and bool(result["ready"])}
