"""A finished run's weights as a checkpoint the fleet serves: for the reference model, its safetensors
and smoke material; for the Llama families, a Hugging Face directory (config.json,
generation_config.json, bf16 safetensors shards + index, and the run's tokenizer) that
``from_pretrained`` and vLLM load unchanged."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from serving.checkpoint import write_model
from serving.model import TinyTransformer, init_model
from serving.model_config import ModelConfig
from training.models import build as build_model
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
    model = build_model(cfg)
    state = {"model": model.state_dict()}
    Checkpointer(Path(inp.checkpoint_dir), 0, 1).load(found.path, state)
    model.load_state_dict(state["model"])
    if cfg.family != "reference":
        return export_hf(model, cfg, Path(inp.export_dir))
    with torch.no_grad():
        return write_model(Path(inp.export_dir), model, cfg.model, version=inp.version)


def export_spec(spec_path: str) -> None:
    """``export_checkpoint`` of the ExportInput in the JSON file ``spec_path`` (a fork server's child)."""
    export_checkpoint(ExportInput(**json.loads(Path(spec_path).read_text())))


def export_hf(model, cfg: TrainConfig, out: Path, max_shard_size: str = "512MB") -> Path:
    """``model`` (training/models.py's HFCausalLM) as a Hugging Face directory in bf16, with the
    tokenizer its corpus was tokenized with (and an end-of-text token as eos), files world-readable."""
    from transformers import PreTrainedTokenizerFast

    from training.corpus import EOS
    from training.data import source_for
    lm = model.lm
    lm = lm.to(torch.bfloat16)
    lm.config.dtype = torch.bfloat16
    tokenizer = None
    if cfg.data:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source_for(cfg).root / "tokenizer.json"),
                                            eos_token=EOS, bos_token=EOS, pad_token=EOS)
        lm.config.eos_token_id = lm.config.bos_token_id = tokenizer.eos_token_id
        lm.generation_config.eos_token_id = lm.generation_config.bos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    for p in out.iterdir():            # save_pretrained writes 0600 shards; a published directory is readable
        p.chmod(0o644)
    return out


def read_export(export_dir: Path, config: ModelConfig, seed: int = 0) -> TinyTransformer:
    """The model an export holds (every safetensors shard), e.g. to check what the fleet answers."""
    model = init_model(config, seed)
    state: dict = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True)
    return model.eval()
