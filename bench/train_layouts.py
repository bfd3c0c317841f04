"""`weightcast bench train`: tokens/s of each parallelism layout on the same model, batch and ranks,
side by side in one run (whole steps: batch, forward, backward with the layout's collectives,
optimiser). Here the ranks share this machine's CPU cores; on GPUs each rank has its own device."""
from __future__ import annotations

from training.config import TrainConfig
from training.launch import launch

MODEL = ["model.vocab=512", "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024",
         "model.max_seq=32", "seq_len=32", "global_batch=16", "lr=1e-3"]


def layout_config(layout: str, ranks: int, steps: int, overrides: list[str]) -> TrainConfig:
    world = 1 if layout == "single" else ranks
    extra = ["tp_degree=2"] if layout == "fsdp_tp" else []
    return TrainConfig.load(None, [*MODEL, *overrides, *extra, f"layout={layout}", f"world_size={world}",
                                   f"steps={steps}"])


def run_layout_bench(layouts: list[str], ranks: int, steps: int, overrides: list[str]) -> dict:
    configs = {name: layout_config(name, ranks, steps, overrides) for name in layouts}   # all checked first
    rows = []
    for name, cfg in configs.items():
        r = launch(cfg)
        rows.append({"layout": name, "world_size": cfg.world_size, "tokens_per_s": round(r["tokens_per_s"], 1),
                     "step_s_median": round(r["step_s_median"], 4), "loss_first": round(r["loss_first"], 4),
                     "loss_last": round(r["loss_last"], 4), "wall_s": r["wall_s"]})
    return {"ranks": ranks, "steps": steps, "device": "cuda" if _cuda() else "cpu", "layouts": rows,
            "includes": "whole steps: batch, forward, backward with the layout's collectives, optimiser step",
            "model_overrides": [*MODEL, *overrides]}


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
