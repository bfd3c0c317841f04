"""`weightcast bench train-recovery`: a rank SIGKILLed at a step, recovered by the TrainingWorkflow
(real dev server, host workers as processes) and, side by side, by ``torchrun --max-restarts`` with
the same model, data, checkpoint interval and checkpoints.

Reported for each: seconds from the kill to the first completed step after recovery (what training
lost, including process start, rendezvous and checkpoint load), steps recomputed (the kill step minus
the step resumed from), and the held-out loss of the final weights against an uninterrupted run with
the same seed (the data order is a function of the step, so it must match). Also: the time training
is blocked by an asynchronous checkpoint against a synchronous save of the same state.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lib.ports import free_ports
from serving.model import init_model
from training.config import TrainConfig
from training.launch import launch
from training.rank import held_out_loss

MODEL = ["model.vocab=512", "model.d_model=384", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1536",
         "model.max_seq=32", "seq_len=32", "global_batch=16", "lr=1e-3", "layout=ddp"]


def _progress(files) -> dict:
    for f in files:
        try:
            return json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
    return {}


def _wait(pred, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"train-recovery: {what} not seen within {timeout:.0f} s")
        time.sleep(0.01)
    return time.monotonic()


def _local(cfg: TrainConfig, root: Path, every: int, synchronous: bool) -> list[float]:
    """An uninterrupted supervised job without Temporal; the save stalls of rank 0."""
    init, procs = f"tcp://127.0.0.1:{free_ports(1)[0]}", []
    for r in range(cfg.world_size):
        d = root / f"rank{r}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "spec.json").write_text(json.dumps({"rank": r, "config": cfg.to_dict(), "out_dir": str(d), "durable": {
            "init_method": init, "checkpoints": str(root / "ckpt"), "every": every, "synchronous": synchronous,
            "progress": str(d / "progress.json")}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "training.supervised_rank", str(d / "spec.json")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        if any(p.wait(timeout=600) != 0 for p in procs):
            raise RuntimeError(f"a rank of the {'synchronous' if synchronous else 'asynchronous'} run failed")
    finally:                                  # a failed or stopped benchmark leaves no rank behind
        for p in procs:
            if p.poll() is None:
                p.kill()
    return json.loads((root / "rank0" / "rank0.json").read_text())["save_stall_s"]


def _torchrun(cfg: TrainConfig, root: Path, every: int, kill_at: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"config": cfg.to_dict(), "out_dir": str(root),
                                "durable": {"checkpoints": str(root / "ckpt"), "every": every,
                                            "collective_timeout_s": 30}}))
    log = open(root / "torchrun.log", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                              "--nproc-per-node", str(cfg.world_size), "--max-restarts", "3",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_ports(1)[0]}",
                              "-m", "training.torchrun_rank", str(spec)],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "TMPDIR": str(root)})   # its agent's scratch, kept with the run
    try:
        first = [root / "restart-0" / "rank1" / "progress.json"]
        _wait(lambda: _progress(first).get("step", 0) >= kill_at, 300, "torchrun's rank 1 at the kill step")
        killed_at = _progress(first)["step"]
        os.kill(_progress(first)["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        again = [root / "restart-1" / "rank0" / "progress.json"]
        t_back = _wait(lambda: (p := _progress(again)).get("step", -1) > p.get("first_step", 10**9), 300,
                       "torchrun's first step after the restart")
        resumed = _progress(again)["first_step"]
        if agent.wait(timeout=600) != 0:
            raise RuntimeError("torchrun did not finish the run")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        log.close()
    rec = json.loads((root / "restart-1" / "rank0" / "rank0.json").read_text())
    return {"recovery_s": round(t_back - t_kill, 3), "killed_at_step": killed_at, "resumed_from_step": resumed,
            "steps_recomputed": killed_at - resumed, "final_loss": rec["held_out_loss"]}


@contextlib.contextmanager
def _quiet_stdout():
    """Child processes (the Temporal dev server prints a banner) write to stderr meanwhile: stdout
    carries only the benchmark's JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


async def _workflow(cfg: TrainConfig, root: Path, every: int, kill_at: int) -> dict:
    from temporalio.testing import WorkflowEnvironment

    from weightcast.stack.module_proc import ModuleProc
    from weightcast.stack.temporal import SEARCH_ATTRIBUTES, temporal_binary
    from workers import control_worker
    from workflows.training import TrainingWorkflow
    from workflows.training_types import TrainingInput
    from workflows.types import CONTROL_QUEUE

    ids = [f"h{i}" for i in range(cfg.world_size)]
    async with await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                     search_attributes=SEARCH_ATTRIBUTES) as env:
        target = env.client.service_client.config.target_host
        procs = [ModuleProc(f"host-worker {i}", "workers.host_worker", root / i,
                            ["--id", i, "--temporal", target, "--store", str(root / i / "store"),
                             "--train-dir", str(root / i / "train"), "--heartbeat-every", "0.5"]).launch()
                 for i in ids]
        try:
            for p in procs:
                await asyncio.to_thread(p.wait_ready)
            async with control_worker.build(env.client, []):
                h = await env.client.start_workflow(TrainingWorkflow.run, TrainingInput(
                    run="bench", config=cfg.to_dict(), hosts=ids, checkpoint_dir=str(root / "ckpt"),
                    checkpoint_every=every, collective_timeout_s=30), id="train-bench", task_queue=CONTROL_QUEUE)
                victim = [root / ids[1] / "train" / "bench" / "attempt-0" / "rank1" / "progress.json"]
                await asyncio.to_thread(_wait, lambda: _progress(victim).get("step", 0) >= kill_at, 300,
                                        "rank 1 at the kill step")
                killed_at = _progress(victim)["step"]
                os.kill(_progress(victim)["pid"], signal.SIGKILL)
                t_kill, wall_kill = time.monotonic(), time.time()
                again = [root / ids[0] / "train" / "bench" / "attempt-1" / "rank0" / "progress.json"]
                t_back = await asyncio.to_thread(
                    _wait, lambda: (p := _progress(again)).get("step", -1) > p.get("first_step", 10**9), 300,
                    "the first step after recovery")
                back = _progress(again)
                resumed = back["first_step"]
                result = await asyncio.wait_for(h.result(), 600)
                parts = _breakdown(await h.fetch_history(), wall_kill, back,
                                   [_progress([root / i / "train" / "bench" / "attempt-1" / f"rank{r}" / "progress.json"])
                                    for r, i in enumerate(ids)])
        finally:
            for p in procs:
                p.stop()
    return {"recovery_s": round(t_back - t_kill, 3), "killed_at_step": killed_at, "resumed_from_step": resumed,
            "steps_recomputed": killed_at - resumed, "final_loss": result.final_loss,
            "recoveries": [r.reason for r in result.recoveries], "breakdown_s": parts}


def _breakdown(history, wall_kill: float, back: dict, ranks: list[dict]) -> dict:
    """Where the recovery's seconds went: the kill reaching Temporal as a failed activity, the workflow
    starting the next attempt's rank activities, the warm rank processes getting their spec, forming the
    process group (waits for the slowest rank), loading the checkpoint, and the first step."""
    failed = next(e.event_time.ToMicroseconds() / 1e6 for e in history.events
                  if e.HasField("activity_task_failed_event_attributes"))
    started = [e.event_time.ToMicroseconds() / 1e6 for e in history.events
               if e.HasField("activity_task_started_event_attributes") and e.event_time.ToMicroseconds() / 1e6 > failed]
    starts = [r["startup"] for r in ranks]
    first_activity = min(started) if started else failed
    spec = max(s["spec"] for s in starts)
    group = max(s["group"] for s in starts)
    loaded = back["startup"]["loaded"]
    return {"failure_recorded": round(failed - wall_kill, 3), "next_attempt_started": round(first_activity - failed, 3),
            "rank_spec_read": round(spec - first_activity, 3), "group_formed": round(group - spec, 3),
            "checkpoint_loaded": round(loaded - group, 3), "first_step": round(back["t"] - loaded, 3)}


def run_train_recovery_bench(ranks: int, steps: int, kill_at: int, every: int, overrides: list[str] = ()) -> dict:
    cfg = TrainConfig.load(None, [*MODEL, *overrides, f"world_size={ranks}", f"steps={steps}"])
    cfg.check()
    if not 0 < kill_at < steps:
        raise ValueError(f"--kill-at must be inside the run (1..{steps - 1})")
    root = Path(tempfile.mkdtemp(prefix="wc-train-recovery-"))
    plain = launch(cfg, root / "uninterrupted")
    model = init_model(cfg.model, cfg.seed)
    model.load_state_dict(torch.load(root / "uninterrupted" / "model.pt"))
    reference = held_out_loss(model, cfg, torch.device("cpu"))
    async_stalls = _local(cfg, root / "async", every, synchronous=False)
    sync_stalls = _local(cfg, root / "sync", every, synchronous=True)
    with _quiet_stdout():
        ours = asyncio.run(_workflow(cfg, root / "workflow", every, kill_at))
    base = _torchrun(cfg, root / "torchrun", every, kill_at)
    for r in (ours, base):
        r["final_loss_matches"] = abs(r["final_loss"] - reference) <= 1e-5 * abs(reference) + 1e-6
    a, s = statistics.median(async_stalls), statistics.median(sync_stalls)
    return {"ranks": ranks, "steps": steps, "checkpoint_every": every, "kill_at": kill_at,
            "weights_mib": round(cfg.model.param_count() * 4 / 2**20, 2),
            "step_s_median": round(plain["step_s_median"], 4), "uninterrupted_final_loss": reference,
            "workflow": ours, "torchrun": base,
            "recovery_over_torchrun": round(ours["recovery_s"] / base["recovery_s"], 3),
            "save_stall_s": {"async_median": round(a, 4), "sync_median": round(s, 4), "async_over_sync": round(a / s, 3)},
            "includes": "recovery: kill to the first completed step after it (process start, rendezvous, checkpoint "
                        "load); stall: the training thread blocked by a save (async: staging copy; sync: the whole write)",
            "workdir": str(root)}
