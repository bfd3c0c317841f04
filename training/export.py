"""A finished run's weights as a checkpoint the fleet serves: HF-style safetensors + smoke material."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from serving.checkpoint import write_model
from serving.model import ModelConfig, TinyTransformer, init_model
from training.checkpoint import Checkpointer, latest
from training.config import ConfigError, TrainConfig
from workflows.training_types import ExportInput


def export_checkpoint(inp: ExportInput) -> Path:
    """Write the newest complete checkpoint's model to ``inp.export_dir``; the smoke answer is
    recorded from these exact weights, so the model server checks the trained model's output."""
    cfg = TrainConfig.from_dict(inp.config)
    found = latest(Path(inp.checkpoint_dir))
    if found is None:
        raise ConfigError(f"no complete checkpoint under {inp.checkpoint_dir}: nothing to export")
    model = init_model(cfg.model, cfg.seed)
    state = {"model": model.state_dict()}
    Checkpointer(Path(inp.checkpoint_dir), 0, 1).load(found.path, state)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        return write_model(Path(inp.export_dir), model, cfg.model, version=inp.version)


def read_export(export_dir: Path, config: ModelConfig, seed: int = 0) -> TinyTransformer:
    """The model an export holds (every safetensors shard), e.g. to check what the fleet answers."""
    model = init_model(config, seed)
    state: dict = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True)
    return model.eval()
