"""`weightcast bench train`: tokens/s and MFU of each parallelism layout on the same model, batch and
ranks, side by side in one run (whole steps: batch, forward, backward with the layout's collectives,
optimiser). MFU is against the matmul peak measured in the same run (training/flops.py). Here the
ranks share this machine's CPU cores; on GPUs each rank has its own device."""
from __future__ import annotations

import tempfile
from pathlib import Path

from training.config import TrainConfig
from training.flops import flops_per_token
from training.launch import launch

MODELS = {
    "reference": ["model.vocab=512", "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024",
                  "model.max_seq=32", "seq_len=32", "global_batch=16", "lr=1e-3"],
    # a Llama shaped like the real ones (GQA 4:1, SwiGLU at 8/3 x d, 32k-ish vocabulary cut to 8k),
    # big enough that its matmuls, not Python, set the pace on a CPU
    "llama": ["family=llama", "model.vocab=8192", "model.d_model=512", "model.n_layers=4", "model.n_heads=8",
              "kv_heads=2", "model.d_ff=1408", "model.max_seq=257", "seq_len=257", "global_batch=8", "lr=1e-3"],
}


def layout_config(layout: str, ranks: int, steps: int, overrides: list[str], model: str = "reference") -> TrainConfig:
    world = 1 if layout == "single" else ranks
    extra = ["tp_degree=2"] if layout == "fsdp_tp" else []
    return TrainConfig.load(None, [*MODELS[model], *overrides, *extra, f"layout={layout}", f"world_size={world}",
                                   f"steps={steps}"])


def run_layout_bench(layouts: list[str], ranks: int, steps: int, overrides: list[str],
                     model: str = "reference") -> dict:
    configs = {name: layout_config(name, ranks, steps, overrides, model) for name in layouts}   # all checked first
    rows, peaks = [], []
    for name, cfg in configs.items():
        with tempfile.TemporaryDirectory(prefix="wc-bench-train-") as d:    # checkpoints and logs not kept
            r = launch(cfg, Path(d))
        peaks.append(r["peak_flops"])
        split = r["step_split"]
        rows.append({"layout": name, "world_size": cfg.world_size, "tokens_per_s": round(r["tokens_per_s"], 1),
                     "mfu": round(r["mfu"], 3), "step_s_median": round(r["step_s_median"], 4),
                     "compute_s": round(split["compute_s"], 4), "comm_s": round(split["comm_s"], 4),
                     "tokens_per_s_by_rank": [round(t, 1) for t in r["tokens_per_s_by_rank"]],
                     "loss_first": round(r["loss_first"], 4), "loss_last": round(r["loss_last"], 4),
                     "wall_s": r["wall_s"]})
    return {"model": model, "ranks": ranks, "steps": steps, "device": "cuda" if _cuda() else "cpu",
            # each launch measures the bound again just before its ranks start; the best is the machine's
            "peak_flops": max(peaks), "flops_per_token": flops_per_token(next(iter(configs.values()))),
            "layouts": rows,
            "includes": "whole steps: batch, forward, backward with the layout's collectives, optimiser step",
            "mfu_is": "tokens/s x flops_per_token (6N + 12 L d T) / the matmul peak measured before each layout ran",
            "model_overrides": [*MODELS[model], *overrides]}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
