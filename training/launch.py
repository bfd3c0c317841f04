"""`weightcast train run`: one training job on this machine, N rank processes (forked from a server
that imported torch once), and a summary of what happened: loss, bytes each rank handed to the process
group per step, throughput."""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp

from training.config import TrainConfig
from training.data import source_for
from training.flops import flops_per_token, matmul_peak
from training.rank import HF_MODEL_IMPORTS, RANK_IMPORTS, device_for, leave, run_rank
from training.rank_logs import log_tail, merge_rank_logs, route_rank_logs


def _peak(cfg: TrainConfig) -> float:
    """The job's matmul bound: one device's measured peak times the ranks on GPUs; on the CPU, the
    measured peak with every thread the ranks use between them (they share the cores)."""
    import torch
    device = device_for(0)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    if device.type == "cuda":
        return _measured_peak(device, dtype) * min(cfg.world_size, torch.cuda.device_count())
    threads = cfg.cpu_threads * cfg.world_size if cfg.cpu_threads else (os.cpu_count() or 1)
    return _measured_peak(device, dtype, threads=threads, seconds=0.3)


# measured once per launching process and setting: a benchmark that launches many jobs compares them
# all against the same bound, and pays the measurement once
_measured_peak = functools.cache(matmul_peak)


class RanksFailed(RuntimeError):
    """A rank process died without a Python exception (a signal, a native abort)."""


class RanksHung(RuntimeError):
    """The ranks did not finish within the launch's timeout; their stacks were dumped to stderr."""


def _spawned_rank(rank: int, cfg_dict: dict, out_dir: str, netns: list[str] | None = None) -> None:
    if netns:                        # each rank behind its own link (lib/netns.py), before any socket
        from lib.netns import enter
        enter(netns[rank])
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    faulthandler.enable()            # a native abort in a collective still names the Python line
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # and a hung rank its stacks, on request
    route_rank_logs(Path(out_dir), rank)       # torch's per-rank warnings into the run's log, not the terminal
    alive = run_rank(rank, cfg_dict, out_dir)     # held until the process ends (see run_rank)
    leave(alive)


class _ProgressWatcher:
    """Follows the progress lines a rank appends after each step, handing each to ``fn`` in order."""

    def __init__(self, path: Path, fn, every_s: float = 0.2):
        self.path, self.fn, self.every_s, self.offset = path, fn, every_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="train-progress", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:                 # no step finished yet
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            self.fn(json.loads(line))

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            self._poll()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self._poll()                              # the last step, if it came after the last poll


def _join(ctx, timeout_s: float | None, work: Path) -> None:
    """Wait for every rank; past ``timeout_s`` ask each for its stacks (SIGUSR1, into its log, which
    is then shown on stderr), then end them."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            pids = [p.pid for p in ctx.processes if p.is_alive()]
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)                      # let faulthandler write
            for r, p in enumerate(ctx.processes):
                if p.is_alive():
                    p.kill()
                    print(f"rank {r} (pid {p.pid}), the end of {work}/rank{r}.log:\n{log_tail(work, r, 80)}",
                          file=sys.stderr)
            raise RanksHung(f"ranks (pids {pids}) still running after {timeout_s:.0f} s; their stacks are on "
                            f"stderr and in {work}/rank*.log")


def launch(cfg: TrainConfig, out_dir: Path | None = None, timeout_s: float | None = None,
           progress=None, netns: list[str] | None = None) -> dict:
    """Run the job to the end; raises ConfigError before any process starts if the config cannot run,
    and RanksHung (after dumping every rank's stacks) if it runs past ``timeout_s``. ``progress(update)``
    is called from a watcher thread with each new ``{step, loss, step_s, t}`` a rank reports. ``netns``:
    one network namespace per rank (a lib/netns.py topology's hosts), each rank's traffic on its link."""
    cfg.check()
    source = source_for(cfg)            # a corpus is tokenized (or found cached) before any rank starts
    work = Path(out_dir or tempfile.mkdtemp(prefix="wc-train-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    (work / "rendezvous").unlink(missing_ok=True)       # a FileStore must start from no file
    (work / "progress.jsonl").unlink(missing_ok=True)
    for r in range(cfg.world_size):                     # a rerun in the same directory logs afresh
        (work / f"rank{r}.log").unlink(missing_ok=True)
    peak = _peak(cfg)                   # the bound MFU is measured against, before the ranks load the cores
    watcher = _ProgressWatcher(work / "progress.jsonl", progress) if progress else None
    try:
        if cfg.world_size == 1 and not netns:
            run_rank(0, cfg.to_dict(), str(work))
        else:
            # ranks fork from one server process per launcher that imported torch and this module once:
            # a spawned rank re-imported both (~2.5 CPU-s each) and the launcher's __main__. The server
            # starts from a fresh interpreter, so a launcher that touched CUDA passes none of it on. It
            # imports what a rank imports lazily too, transformers' Llama-family code included whatever
            # this run's model: the server is started once per launcher, by its first run (1.5 CPU-s
            # once, against 1.5 in every Llama-family rank)
            mp.set_forkserver_preload(["training.launch", *RANK_IMPORTS, *HF_MODEL_IMPORTS])
            ctx = mp.start_processes(_spawned_rank, args=(cfg.to_dict(), str(work), netns), nprocs=cfg.world_size,
                                     start_method="forkserver", join=False)
            try:
                _join(ctx, timeout_s, work)
            except mp.ProcessExitedException as e:      # a native death: its last words are in its log
                raise RanksFailed(f"{e}; the end of rank {e.error_index}'s log ({work}/rank{e.error_index}.log):\n"
                                  + log_tail(work, e.error_index)) from e
    finally:
        if watcher:
            watcher.stop()
    wall = time.perf_counter() - t0
    log, distinct = merge_rank_logs(work, cfg.world_size)
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(cfg.world_size)]
    steps = cfg.steps
    # the loss of a step is the mean over the whole global batch: weight each reporting rank by its
    # share of that step (shares move when rebalancing)
    reporting = [r for r in ranks if r["losses"] is not None]
    loss = [sum(r["losses"][s] * r["samples"][s] for r in reporting) / sum(r["samples"][s] for r in reporting)
            for s in range(steps)]
    steady = slice(min(2, steps - 1), steps)                     # the first steps include warm-up
    step_s = [max(r["step_s"][s] for r in ranks) for s in range(steps)]
    tokens = cfg.global_batch * (cfg.seq_len - 1)
    median_s = statistics.median(step_s[steady])
    # the share of a step some collective was in flight, from each rank's profiled steps (training/comm_time.py)
    fractions = [sum(c for _, c, _ in r["comm_samples"]) / sum(t for _, _, t in r["comm_samples"])
                 for r in ranks if r["comm_samples"]]
    comm_fraction = statistics.mean(fractions) if fractions and cfg.world_size > 1 else 0.0
    fpt = flops_per_token(cfg)
    summary = {"layout": cfg.layout, "comm": cfg.comm, "world_size": cfg.world_size, "device": ranks[0]["device"],
               "steps": steps, "loss_first": loss[0], "loss_last": loss[-1],
               "loss_floor": source.entropy_floor(),
               "losses": loss, "eval_losses": ranks[0]["eval_losses"], "sent_bytes_per_step_per_rank": None if ranks[0]["sent_bytes"] is None else
               statistics.mean(statistics.mean(r["sent_bytes"][steady]) for r in ranks),
               "step_s": step_s, "step_s_median": statistics.median(step_s[steady]),
               "tokens_per_s": tokens / median_s,
               "tokens_per_s_by_rank": [statistics.mean(r["samples"][steady]) * (cfg.seq_len - 1) / median_s
                                        for r in ranks],
               "flops_per_token": fpt, "peak_flops": peak, "mfu": tokens / median_s * fpt / peak,
               "step_split": {"compute_s": median_s * (1 - comm_fraction), "comm_s": median_s * comm_fraction,
                              "comm_fraction": comm_fraction},
               "samples_per_step_by_rank": [statistics.mean(r["samples"][steady]) for r in ranks],
               "param_bytes_by_rank": [r["param_bytes"] for r in ranks],
               "wire_bytes_sent_by_rank": [r["wire_bytes_sent"] for r in ranks],
               "wall_s": round(wall, 2), "out_dir": str(work), "log": str(log), "log_messages": distinct,
               "config": cfg.to_dict()}
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(summary, indent=1))
    return summary
