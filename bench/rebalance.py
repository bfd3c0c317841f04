"""`weightcast bench rebalance`: one of N data-parallel ranks at a fraction of the others' speed, with
and without rebalancing, against the same job balanced, side by side in one run.

Three DDP runs of the same model and global batch: all ranks at full speed (the balanced step time
T); the last rank slowed by ``--slowdown`` (an injected delay proportional to its own compute, config
``slow_ranks``) with equal shares; and slowed with ``rebalance=true``. With one rank at speed 1/f the
fleet's capacity is (N - 1 + 1/f) ranks, so the best step time is T * N / (N - 1 + 1/f) (for f = 2,
N / (N - 1/2)); equal shares make every step wait for the slow rank, about f * T. Step times are the
median of the slowest rank's step over the steady steps and include everything a step does (making
the batch, forward, backward with its gradient reduction, optimiser step, the rate exchange). With
``--link`` each rank runs in its own network namespace behind a link the kernel shapes to that rate
(lib/netns.py), so the gradient reduction crosses real, limited links.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from lib.netns import Topology
from training.config import TrainConfig
from training.launch import launch

MODEL = ["model.vocab=512", "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.d_ff=1024",
         "model.max_seq=32", "seq_len=32", "lr=1e-3"]


def rebalance_config(ranks: int, steps: int, batch_per_rank: int, overrides: list[str], extra: list[str] = ()
                     ) -> TrainConfig:
    return TrainConfig.load(None, [*MODEL, *overrides, "layout=ddp", f"world_size={ranks}", f"steps={steps}",
                                   f"global_batch={batch_per_rank * ranks}", *extra])


def run_rebalance_bench(ranks: int, slowdown: float, steps: int, batch_per_rank: int, overrides: list[str],
                        link_bps: float | None = None) -> dict:
    slow = f'slow_ranks={{"{ranks - 1}": {slowdown}}}'
    with contextlib.ExitStack() as stack:
        netns = None
        if link_bps:
            net = stack.enter_context(Topology([ranks], link_bps, link_bps))
            netns = [h.ns for h in net.hosts]
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wc-bench-rebalance-")))  # not kept
        runs = {name: launch(rebalance_config(ranks, steps, batch_per_rank, overrides, extra), work / name, netns=netns)
                for name, extra in (("balanced", []), ("slow_equal_shares", [slow]),
                                    ("slow_rebalanced", [slow, "rebalance=true"]))}
    t = runs["balanced"]["step_s_median"]
    ideal = t * ranks / (ranks - 1 + 1 / slowdown)
    rows = {name: {"step_s_median": round(r["step_s_median"], 4), "vs_balanced": round(r["step_s_median"] / t, 3),
                   "vs_ideal": round(r["step_s_median"] / ideal, 3),
                   "samples_per_step_by_rank": [round(x, 2) for x in r["samples_per_step_by_rank"]],
                   "loss_last": round(r["loss_last"], 4), "tokens_per_s": round(r["tokens_per_s"], 1)}
            for name, r in runs.items()}
    return {"ranks": ranks, "slowdown": slowdown, "slow_rank": ranks - 1, "steps": steps, "link_bytes_per_s": link_bps,
            "global_batch": batch_per_rank * ranks, "ideal_step_s": round(ideal, 4),
            "ideal_vs_balanced": round(ranks / (ranks - 1 + 1 / slowdown), 4), "runs": rows,
            "includes": "whole steps: batch, forward, backward + gradient all-reduce, optimiser, rate exchange",
            "model_overrides": [*MODEL, *overrides]}
