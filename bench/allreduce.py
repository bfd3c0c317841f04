"""`weightcast bench allreduce`: the gradient methods side by side on a link that really limits them.

The ranks run inside a private network namespace (``unshare -rn``, no privileges needed) whose
loopback is rate-limited with ``tc qdisc ... tbf``: every byte between ranks crosses that one limited
loopback, so all ranks share one link of ``--link`` (a real fleet gives each host its own). For each
method (and plain all-reduce without overlap, and with 1 MB buckets), in one run: bytes each rank hands to the process group per step, step time, loss after the
same number of steps, and training time until the loss plain all-reduce reaches after ``--steps``
(every method may run up to twice as many steps to get there): on the training loss of each step,
and on the held-out loss evaluated about eight times up to ``--steps`` (evaluations not timed). Plain all-reduce's bus bandwidth,
2(n-1)/n * S / t, is timed apart on bare ``all_reduce`` calls of the gradient's size (inside a step
it overlaps backward and cannot be separated); on the shared loopback the best possible is link / n
(n ranks' ring traffic all crosses it), reported as ``shared_link_busbw_bound``.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.config import TrainConfig
from training.launch import launch

# (row, comm, extra settings): the baseline, its overlap and bucket variants, then every method
METHODS = (("allreduce", "allreduce", []), ("allreduce_no_overlap", "allreduce", ["overlap=false"]),
           ("allreduce_bucket_1mb", "allreduce", ["bucket_mb=1"]), ("fp16", "fp16", []), ("int8_ef", "int8_ef", []),
           ("topk_ef", "topk_ef", []), ("powersgd", "powersgd", []), ("local_sgd", "local_sgd", []),
           ("diloco", "diloco", []))
DEFAULT_MODEL = ["model.vocab=1024", "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024",
                 "model.max_seq=32", "seq_len=32", "global_batch=8", "lr=3e-3"]
BUSBW_REPEATS = 5


def method_config(ranks: int, steps: int, overrides: list[str], comm: str = "allreduce",
                  extra: list[str] = ()) -> TrainConfig:
    """One method's run: the benchmark's model, the caller's overrides, up to twice ``steps`` steps.
    Raises ConfigError (so the CLI can refuse bad settings before entering the namespace)."""
    return TrainConfig.load(None, [*DEFAULT_MODEL, f"eval_every={eval_every(steps)}", *overrides, *extra,
                                   "layout=ddp", f"world_size={ranks}", f"comm={comm}", f"steps={2 * steps}"])


def eval_every(steps: int) -> int:
    """Held-out evaluations: about eight up to ``steps``, one exactly at ``steps``."""
    return next(e for e in range(max(1, steps // 8), steps + 1) if steps % e == 0)


class NamespaceError(RuntimeError):
    pass


def run_allreduce_bench(ranks: int, link_bps: float, steps: int, overrides: list[str], timeout: float = 3600) -> dict:
    """Re-run this module inside a rate-limited private network namespace and return its JSON."""
    bits = int(link_bps * 8)
    burst = max(32 * 1024, int(link_bps / 100))          # 10 ms at the rate: smooth, not bursty
    inner = [sys.executable, "-m", "bench.allreduce", "--inside", json.dumps(
        {"ranks": ranks, "link_bps": link_bps, "steps": steps, "overrides": overrides})]
    script = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {bits}bit burst {burst} latency 500ms "
              f"&& exec {shlex.join(inner)}")
    try:
        proc = subprocess.run(["unshare", "-rn", "sh", "-c", script], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                    "GLOO_SOCKET_IFNAME": "lo"})   # the only interface there
    except FileNotFoundError:
        raise NamespaceError("`unshare` not found (util-linux): the benchmark needs a private network namespace")
    except subprocess.TimeoutExpired:
        raise NamespaceError(f"the benchmark did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise NamespaceError(f"the rate-limited namespace run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _time_to(losses: list[float], step_s: list[float], target: float) -> float | None:
    t = 0.0
    for loss, s in zip(losses, step_s):
        t += s
        if loss <= target:
            return round(t, 3)
    return None


def _time_to_eval(evals: list, step_s: list[float], target: float) -> float | None:
    """Training time (the steps' own, evaluations excluded) until the held-out loss is at ``target``."""
    for step, loss in evals:
        if loss <= target:
            return round(sum(step_s[:step]), 3)
    return None


def _busbw_rank(rank: int, world: int, nbytes: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"file://{Path(out_dir, 'rendezvous').resolve()}")
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    dist.all_reduce(t)                                       # connect and warm up
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(BUSBW_REPEATS):
        dist.all_reduce(t)
    seconds = (time.perf_counter() - t0) / BUSBW_REPEATS
    if rank == 0:
        Path(out_dir, "busbw.json").write_text(json.dumps({"seconds": seconds}))
    dist.barrier()                                           # nobody closes its connections early
    dist.destroy_process_group()


def allreduce_seconds(world: int, nbytes: int) -> float:
    """Seconds for one bare fp32 all-reduce of ``nbytes`` across ``world`` ranks (gloo), averaged."""
    with tempfile.TemporaryDirectory(prefix="wc-busbw-") as d:
        mp.start_processes(_busbw_rank, args=(world, nbytes, d), nprocs=world, start_method="spawn", join=True)
        return json.loads(Path(d, "busbw.json").read_text())["seconds"]


def inside(ranks: int, link_bps: float, steps: int, overrides: list[str]) -> dict:
    runs = {}
    for name, comm, extra in METHODS:
        runs[name] = launch(method_config(ranks, steps, overrides, comm, extra))
    plain = runs["allreduce"]
    target = plain["losses"][steps - 1]                      # where plain all-reduce is after --steps
    eval_target = dict(plain["eval_losses"])[steps]          # and its held-out loss there
    grad_bytes = plain["sent_bytes_per_step_per_rank"]
    ring = 2 * (ranks - 1) / ranks
    t_comm = allreduce_seconds(ranks, int(grad_bytes))
    rows = []
    for m, r in runs.items():
        rows.append({"method": m, "sent_bytes_per_step_per_rank": r["sent_bytes_per_step_per_rank"],
                     "bytes_vs_allreduce": round(r["sent_bytes_per_step_per_rank"] / grad_bytes, 4),
                     "step_s_median": round(r["step_s_median"], 4), "loss_first": round(r["loss_first"], 4),
                     "loss_after_steps": round(r["losses"][steps - 1], 4),
                     "time_to_target_s": _time_to(r["losses"], r["step_s"], target),
                     "eval_loss_after_steps": round(dict(r["eval_losses"])[steps], 4),
                     "time_to_eval_target_s": _time_to_eval(r["eval_losses"], r["step_s"], eval_target),
                     "tokens_per_s": round(r["tokens_per_s"], 1)})
    base_t, base_e = rows[0]["time_to_target_s"], rows[0]["time_to_eval_target_s"]
    for row in rows:
        row["speedup_to_target"] = round(base_t / row["time_to_target_s"], 3) if row["time_to_target_s"] else None
        row["speedup_to_eval_target"] = (round(base_e / row["time_to_eval_target_s"], 3)
                                         if row["time_to_eval_target_s"] else None)
    busbw = ring * grad_bytes / t_comm if t_comm > 0 else None
    return {"ranks": ranks, "link_bytes_per_s": link_bps, "steps": steps, "target_loss": round(target, 4),
            "eval_target_loss": round(eval_target, 4),
            "gradient_bytes": grad_bytes, "ring_bound_s": round(ring * grad_bytes / link_bps, 4),
            "allreduce_s": round(t_comm, 4), "allreduce_busbw_bytes_per_s": busbw and round(busbw),
            "shared_link_busbw_bound": round(link_bps / ranks),
            "busbw_over_shared_bound": busbw and round(busbw / (link_bps / ranks), 3),
            "note": "all ranks share one rate-limited loopback: the ring's n flows divide the link",
            "methods": rows, "model_overrides": [*DEFAULT_MODEL, *overrides]}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inside":
        a = json.loads(sys.argv[2])
        print(json.dumps(inside(a["ranks"], a["link_bps"], a["steps"], a["overrides"])))
