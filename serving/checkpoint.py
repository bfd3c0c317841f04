"""Hugging Face–style sharded safetensors checkpoints of the reference model, with smoke-test material.

Layout: ``model-0000x-of-0000y.safetensors``, ``model.safetensors.index.json`` (weight_map), and
``weightcast_smoke.json``: the model config, a fixed input, the expected logits for it and a tolerance,
recorded when the checkpoint is written so the smoke test checks the *answer*.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from serving.model import TinyTransformer, init_model
from serving.model_config import ModelConfig

INDEX = "model.safetensors.index.json"
SMOKE = "weightcast_smoke.json"


def smoke_input(c: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, c.vocab, (2, min(16, c.max_seq)), generator=g).tolist()


@torch.no_grad()
def expected_logits(model: TinyTransformer, ids: list[list[int]]) -> list[list[float]]:
    out = model(torch.tensor(ids))
    return out[:, -1, :16].tolist()   # the last position's first 16 logits per row: enough to tell versions apart


def write_checkpoint(root: Path, config: ModelConfig, seed: int, shard_bytes: int = 256 * 1024 * 1024,
                     version: str = "") -> Path:
    return write_model(root, init_model(config, seed), config, shard_bytes, version)


def write_model(root: Path, model: TinyTransformer, config: ModelConfig, shard_bytes: int = 256 * 1024 * 1024,
                version: str = "") -> Path:
    """This model's weights as sharded safetensors, and its answer to the smoke input."""
    root.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    ids = smoke_input(config)
    (root / SMOKE).write_text(json.dumps({"config": config.to_dict(), "version": version, "input_ids": ids,
                                          "expected": expected_logits(model, ids), "atol": 1e-3, "rtol": 1e-3}))
    return root
