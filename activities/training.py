"""Host activities of a durable training run: a rendezvous address, one supervised rank process, export.

``train_rank`` starts ``python -m training.supervised_rank`` in its own session, heartbeats the step,
loss and last complete checkpoint it reads from the rank's progress file, and on cancellation kills
the process group. A rank that exits non-zero fails the activity (non-retryable): the workflow, not a
retry, decides how to recover.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from training.archive_sync import Archiver
from training.control import Control, write
from weightcast.stack.processes import last_lines
from workflows.training_types import ExportInput, RunControl, TrainRankInput, TrainRankResult


class TrainingActivities:
    def __init__(self, host_id: str, work: Path, advertise_host: str = "127.0.0.1", poll_s: float = 0.5,
                 warm: bool = True):
        self.host_id, self.work, self.advertise, self.poll_s, self.warm = host_id, work, advertise_host, poll_s, warm
        self._ready: asyncio.subprocess.Process | None = None     # a rank process with torch imported, waiting

    async def _rank_process(self, spec: Path, log: Path) -> asyncio.subprocess.Process:
        """A warm process if one is ready (then another is started for next time), else a fresh one."""
        proc, self._ready = self._ready, None
        if proc is None or proc.returncode is not None:
            with open(log, "ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "training.supervised_rank", str(spec), stdout=out, stderr=out,
                    start_new_session=True)
        else:
            proc.stdin.write(f"{spec}\t{log}\n".encode())
            await proc.stdin.drain()
            proc.stdin.close()
        if self.warm:
            self.work.mkdir(parents=True, exist_ok=True)
            self._ready = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "training.supervised_rank", "--warm", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        return proc

    @activity.defn(name="rendezvous")
    async def rendezvous(self, run: str) -> str:
        """A TCP address on this host for rank 0's store (a fresh port per attempt: no stale store)."""
        with socket.socket() as s:
            s.bind((self.advertise, 0))
            return f"tcp://{self.advertise}:{s.getsockname()[1]}"

    @activity.defn(name="train_rank")
    async def train_rank(self, inp: TrainRankInput) -> TrainRankResult:
        d = self.work / inp.run / f"attempt-{inp.attempt}" / f"rank{inp.rank}"
        d.mkdir(parents=True, exist_ok=True)
        progress = d / "progress.json"
        spec = d / "spec.json"
        spec.write_text(json.dumps({"rank": inp.rank, "config": inp.config, "out_dir": str(d), "durable": {
            "init_method": inp.init_method, "checkpoints": inp.checkpoint_dir, "every": inp.checkpoint_every,
            "progress": str(progress), "collective_timeout_s": inp.collective_timeout_s,
            "control": str(self._control(inp.run))}}))
        archiver = Archiver(inp.archive, Path(inp.checkpoint_dir)) if inp.archive else None
        if archiver:
            await archiver.restore_if_newer()
        proc = await self._rank_process(spec, d / "rank.log")
        try:
            while True:
                try:
                    await asyncio.wait_for(proc.wait(), timeout=self.poll_s)
                    break
                except asyncio.TimeoutError:
                    beat = _compact(progress, proc.pid)
                    if archiver and inp.rank == 0:
                        archiver.archive_soon()
                        beat["archived"] = archiver.archived
                    activity.heartbeat(beat)
        except asyncio.CancelledError:
            _kill(proc.pid)
            if archiver:
                archiver.cancel()
            await proc.wait()
            raise
        if archiver and inp.rank == 0 and proc.returncode == 0:
            await archiver.archive_newest()         # the final state, before the run reports success
        if proc.returncode != 0:
            tail = [ln for ln in last_lines(d / "rank.log", 3) if ln.strip()]
            how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exited with {proc.returncode}")
            raise ApplicationError(f"rank {inp.rank} on {self.host_id} {how}" + (": " + " | ".join(tail) if tail else ""),
                                   type="RankFailed", non_retryable=True)
        rec = json.loads((d / f"rank{inp.rank}.json").read_text())
        return TrainRankResult(inp.rank, rec["next_step"], rec["first_step"], rec["held_out_loss"], rec["save_stall_s"],
                               rec["paused"])

    @activity.defn(name="set_run_control")
    async def set_run_control(self, inp: RunControl) -> None:
        """Pause / checkpoint-now for the run's ranks: rank 0 on this host reads it after every step."""
        write(self._control(inp.run), Control(inp.pause, inp.checkpoint_seq))

    def _control(self, run: str) -> Path:
        return self.work / run / "control.json"

    @activity.defn(name="export_weights")
    async def export_weights(self, inp: ExportInput) -> str:
        """The newest complete checkpoint as an HF-style safetensors checkpoint with smoke material."""
        from training.export import export_checkpoint
        return str(await asyncio.to_thread(export_checkpoint, inp))


def _compact(progress: Path, pid: int) -> dict:
    try:
        p = json.loads(progress.read_text())
    except (OSError, ValueError):
        return {"pid": pid, "step": None}
    return {"pid": pid, "step": p["step"], "loss": None if p["loss"] is None else round(p["loss"], 5),
            "step_s": None if p["step_s"] is None else round(p["step_s"], 4),
            "last_checkpoint": p["last_checkpoint"], "first_step": p["first_step"]}


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
