"""Host activities of a durable training run: a rendezvous address, one supervised rank process, export.

``train_rank`` forks a rank (training/supervised_rank.py) in its own session from the host's fork
server (training/fork_server.py), heartbeats the step, loss and last complete checkpoint it reads
from the rank's progress file, and on cancellation kills the process group. ``export_weights`` forks
the export of the finished weights from the same server. The worker itself never imports torch: the
fork server and its children do. A rank that exits non-zero fails the activity (non-retryable): the
workflow, not a retry, decides how to recover.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from pathlib import Path

import aiohttp
from temporalio import activity
from temporalio.exceptions import ApplicationError

from training.checkpoint_swarm import CheckpointSwarm
from training.config import TrainConfig
from training.control import Control, write
from training.flops import flops_per_token, model_parallel_degree
from training.fork_server import ForkServer
from training.metrics import TrainingMetrics
from lib.ports import free_ports
from lib.processes import describe_exit, last_lines
from workflows.training_types import (ExportInput, RunControl, TrainRankInput, TrainRankResult, host_checkpoint_dir,
                                      node_local)

class TrainingActivities:
    def __init__(self, host_id: str, work: Path, advertise_host: str = "127.0.0.1", poll_s: float = 0.5,
                 peerd: str = "", token: str = "", store: Path | None = None, registry=None):
        self.host_id, self.work, self.advertise, self.poll_s = host_id, work, advertise_host, poll_s
        self.peerd, self.token, self.store = peerd, token, store      # node-local checkpoints move through peerd
        # torch lives in the fork server and the ranks it forks, never in the worker itself
        self.forks = ForkServer(self.work / "fork-server.log")
        self.metrics = TrainingMetrics(registry) if registry is not None else None
        self._peaks: dict[tuple[int, str], float] = {}   # matmul FLOP/s by threads and precision (MFU's bound)

    @activity.defn(name="rendezvous")
    async def rendezvous(self, run: str) -> str:
        """A TCP address on this host for rank 0's store (a fresh port per attempt: no stale store)."""
        return f"tcp://{self.advertise}:{free_ports(1, self.advertise)[0]}"

    @activity.defn(name="train_rank")
    async def train_rank(self, inp: TrainRankInput) -> TrainRankResult:
        d = self.work / inp.run / f"attempt-{inp.attempt}" / f"rank{inp.rank}"
        d.mkdir(parents=True, exist_ok=True)
        progress = d / "progress.json"
        spec = d / "spec.json"
        root = Path(host_checkpoint_dir(inp.checkpoint_dir, self.host_id))
        swarm = self._swarm(inp.run, root) if node_local(inp.checkpoint_dir) else None
        spec.write_text(json.dumps({"rank": inp.rank, "config": inp.config, "out_dir": str(d), "durable": {
            "init_method": inp.init_method, "checkpoints": str(root), "every": inp.checkpoint_every,
            "every_s": inp.checkpoint_every_s,
            "progress": str(progress), "collective_timeout_s": inp.collective_timeout_s,
            "control": str(self._control(inp.run)), "local_checkpoints": swarm is not None}}))
        archiver = None
        if inp.archive:
            # imported here: the S3 client is a tenth of a host worker's start, and only archiving runs use it
            from training.archive_sync import Archiver
            archiver = Archiver(inp.archive, root)
        fetched = None
        if swarm:                                   # a newer checkpoint a peer holds: through the swarm
            fetched = await _beating(swarm.restore_newest(), lambda: {"restoring": True}, self.poll_s)
        if archiver:
            await archiver.restore_if_newer()
        cfg = TrainConfig.from_dict(inp.config)
        # a rank's share of the FLOPs, and the bound (the first one waits for the fork server's start)
        speed = (flops_per_token(cfg) / model_parallel_degree(cfg),
                 await _beating(self._peak(cfg), lambda: {"starting": True}, self.poll_s))
        proc = await _beating(self.forks.start(spec, d / "rank.log"), lambda: {"starting": True}, self.poll_s)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.poll_s):     # wait_for could drop a cancel (peerd/job.py)
                        await proc.wait()
                    break
                except TimeoutError:
                    beat = _compact(progress, proc.pid, *speed)
                    if self.metrics:
                        self.metrics.observe(inp.run, inp.rank, beat)
                    if swarm:
                        swarm.replicate_soon()
                        beat["replicated"] = swarm.replicated
                    if archiver and inp.rank == 0:
                        archiver.archive_soon()
                        beat["archived"] = archiver.archived
                    activity.heartbeat(beat)
        except asyncio.CancelledError:
            proc.kill()
            for background in (archiver, swarm):
                if background:
                    background.cancel()
            await proc.wait()
            raise
        if swarm and proc.returncode == 0:          # the final checkpoint whole on this host (export reads it)
            try:
                await _beating(swarm.finish(), lambda: {**_compact(progress, proc.pid), "replicating": True}, self.poll_s)
            except asyncio.CancelledError:
                swarm.cancel()
                raise
            except (RuntimeError, TimeoutError, aiohttp.ClientError) as e:
                raise ApplicationError(f"rank {inp.rank} on {self.host_id} finished, but its final checkpoint "
                                       f"was not replicated here: {e}", type="RankFailed", non_retryable=True) from e
        if archiver and inp.rank == 0 and proc.returncode == 0:
            await archiver.archive_newest()         # the final state, before the run reports success
        if proc.returncode != 0:
            if swarm:
                swarm.cancel()
            tail = [ln for ln in last_lines(d / "rank.log", 3) if ln.strip()]
            how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exited with {proc.returncode}")
            raise ApplicationError(f"rank {inp.rank} on {self.host_id} {how}" + (": " + " | ".join(tail) if tail else ""),
                                   {"signal": signal.Signals(-proc.returncode).name if proc.returncode < 0 else None},
                                   type="RankFailed", non_retryable=True)
        rec = json.loads((d / f"rank{inp.rank}.json").read_text())
        if self.metrics:
            self.metrics.observe(inp.run, inp.rank, {**_compact(progress, proc.pid, *speed),
                                                     "eval_loss": rec["held_out_loss"]})
        return TrainRankResult(inp.rank, rec["next_step"], rec["first_step"], rec["held_out_loss"], rec["save_stall_s"],
                               rec["paused"], fetched)

    async def _peak(self, cfg: TrainConfig) -> float:
        """This host's matmul peak with the threads one rank uses, measured once (before any rank of
        this worker loads the cores) and kept."""
        threads = cfg.cpu_threads or max(1, (os.cpu_count() or 1) // cfg.world_size)
        if (threads, cfg.precision) not in self._peaks:
            self._peaks[threads, cfg.precision] = await self.forks.peak(threads, cfg.precision)
        return self._peaks[threads, cfg.precision]

    @activity.defn(name="set_run_control")
    async def set_run_control(self, inp: RunControl) -> None:
        """Pause / checkpoint-now for the run's ranks: rank 0 on this host reads it after every step."""
        write(self._control(inp.run), Control(inp.pause, inp.checkpoint_seq))

    def _swarm(self, run: str, root: Path) -> CheckpointSwarm:
        if not self.store:
            raise ApplicationError(f"node-local checkpoints need this host's peerd, but the host worker on "
                                   f"{self.host_id} was started without --store", type="NoPeerd", non_retryable=True)
        return CheckpointSwarm(run, root, self.peerd, self.token, self.store)

    def _control(self, run: str) -> Path:
        return self.work / run / "control.json"

    @activity.defn(name="export_weights")
    async def export_weights(self, inp: ExportInput) -> str:
        """The newest complete checkpoint as an HF-style safetensors checkpoint with smoke material."""
        here = dataclasses.replace(inp, checkpoint_dir=host_checkpoint_dir(inp.checkpoint_dir, self.host_id))
        d = self.work / inp.run / f"export-{activity.info().attempt}"
        d.mkdir(parents=True, exist_ok=True)
        spec = d / "spec.json"
        spec.write_text(json.dumps(dataclasses.asdict(here)))
        proc = await self.forks.start(spec, d / "export.log", kind="export")     # torch lives in the fork server
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        if code != 0:
            tail = [ln for ln in last_lines(d / "export.log", 3) if ln.strip()]
            raise ApplicationError(f"the export on {self.host_id} {describe_exit(code)}: " + " | ".join(tail),
                                   type="ExportFailed")
        return inp.export_dir


async def _beating(work, beat, every_s: float):
    """Await ``work`` while heartbeating: a host busy replicating a checkpoint is not a silent host."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=every_s)
            if done:
                return task.result()
            activity.heartbeat(beat())
    finally:
        task.cancel()


def _compact(progress: Path, pid: int, flops_per_token: float = 0.0, peak: float = 0.0) -> dict:
    """The heartbeat: the rank's progress, with its speed (tokens/s, MFU against ``peak``)."""
    try:
        p = json.loads(progress.read_text())
    except (OSError, ValueError):
        return {"pid": pid, "step": None}
    tokens_per_s = p["tokens"] / p["step_s"] if p.get("tokens") and p.get("step_s") else None
    return {"pid": pid, "step": p["step"], "loss": None if p["loss"] is None else round(p["loss"], 5),
            "step_s": None if p["step_s"] is None else round(p["step_s"], 4),
            "last_checkpoint": p["last_checkpoint"], "first_step": p["first_step"],
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1),
            "mfu": round(tokens_per_s * flops_per_token / peak, 4) if tokens_per_s and peak else None,
            "comm_fraction": None if p.get("comm_fraction") is None else round(p["comm_fraction"], 4)}
