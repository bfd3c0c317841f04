"""`weightcast bench allreduce`: the gradient methods side by side on links that really limit them.

Each rank runs in a network namespace of its own behind a link the kernel shapes to ``--link`` in
both directions (lib/netns.py: one veth per rank into a bridge, tc tbf on both ends), as each host of
a real fleet has its own NIC. For each
method (and plain all-reduce without overlap, and with 1 MB buckets), in one run: bytes each rank hands to the process group per step, step time, loss after the
same number of steps, and training time until the loss plain all-reduce reaches after ``--steps``
(every method may run up to twice as many steps to get there): on the training loss of each step,
and on the held-out loss evaluated about eight times up to ``--steps`` (evaluations not timed). Plain all-reduce's bus bandwidth,
2(n-1)/n * S / t, is timed apart on bare ``all_reduce`` calls of the gradient's size (inside a step
it overlaps backward and cannot be separated), against the ring's bound: the link's payload rate
(headers take ~4.4 % of a shaped link at MTU 1500), so an all-reduce takes at least
2(n-1)/n * S / (payload share * link).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lib.netns import PAYLOAD_SHARE, NetnsError, Topology, enter
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


def run_allreduce_bench(ranks: int, link_bps: float, steps: int, overrides: list[str]) -> dict:
    """Every method with each rank behind its own ``link_bps`` link; the namespaces go however it ends."""
    try:
        with Topology([ranks], link_bps, link_bps) as net:
            return inside(ranks, link_bps, steps, overrides, [h.ns for h in net.hosts])
    except NetnsError as e:
        raise NamespaceError(f"the benchmark needs a network namespace per rank (root, ip, tc): {e}") from None


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


def _busbw_rank(rank: int, world: int, nbytes: int, out_dir: str, netns: list[str]) -> None:
    enter(netns[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
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


def allreduce_seconds(world: int, nbytes: int, netns: list[str]) -> float:
    """Seconds for one bare fp32 all-reduce of ``nbytes`` across ``world`` ranks (gloo), one rank in
    each of ``netns``, averaged."""
    with tempfile.TemporaryDirectory(prefix="wc-busbw-") as d:
        mp.start_processes(_busbw_rank, args=(world, nbytes, d, netns), nprocs=world, start_method="spawn",
                           join=True)
        return json.loads(Path(d, "busbw.json").read_text())["seconds"]


def inside(ranks: int, link_bps: float, steps: int, overrides: list[str], netns: list[str]) -> dict:
    runs = {}
    for name, comm, extra in METHODS:
        with tempfile.TemporaryDirectory(prefix="wc-bench-allreduce-") as d:    # checkpoints and logs not kept
            runs[name] = launch(method_config(ranks, steps, overrides, comm, extra), Path(d), netns=netns)
    plain = runs["allreduce"]
    target = plain["losses"][steps - 1]                      # where plain all-reduce is after --steps
    eval_target = dict(plain["eval_losses"])[steps]          # and its held-out loss there
    grad_bytes = plain["sent_bytes_per_step_per_rank"]
    ring = 2 * (ranks - 1) / ranks
    t_comm = allreduce_seconds(ranks, int(grad_bytes), netns)
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
    payload = PAYLOAD_SHARE * link_bps                     # what a shaped link carries of TCP payload
    return {"ranks": ranks, "link_bytes_per_s": link_bps, "steps": steps, "target_loss": round(target, 4),
            "eval_target_loss": round(eval_target, 4),
            "gradient_bytes": grad_bytes, "ring_bound_s": round(ring * grad_bytes / link_bps, 4),
            "ring_bound_payload_s": round(ring * grad_bytes / payload, 4),
            "allreduce_s": round(t_comm, 4), "allreduce_busbw_bytes_per_s": busbw and round(busbw),
            "busbw_over_ring_bound": busbw and round(busbw / payload, 3),
            "note": "each rank in its own namespace behind its own kernel-shaped link (lib/netns.py)",
            "methods": rows, "model_overrides": [*DEFAULT_MODEL, *overrides]}
