"""The models a run trains, behind one shape the layouts know: ``forward(ids) -> logits`` and
``blocks`` (the decoder layers FSDP shards one by one and tensor parallelism splits by ``TP_PLANS``).

- ``reference``: weightcast's own ``TinyTransformer`` (serving/model.py).
- ``llama``, ``qwen2``, ``mistral``: the Hugging Face ``transformers`` model of that family, built
  from a config (``model.*`` sizes, ``kv_heads`` for grouped-query attention); the same code that
  serves such a checkpoint trains it, so an export is a directory ``from_pretrained`` loads unchanged.
"""
from __future__ import annotations

import torch
from torch import nn


# Megatron-style splits (module names inside one block): column-wise in, row-wise out, so each block
# needs one all-reduce forward and one backward. For the HF families q/k/v split whole heads and whole
# KV heads (grouped-query attention keeps its ratio on every rank), gate/up the MLP's columns.
TP_PLANS = {
    "reference": {"attn.wq": "col", "attn.wk": "col", "attn.wv": "col", "attn.wo": "row", "ff.0": "col",
                  "ff.2": "row"},
    "hf": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
           "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}


class HFCausalLM(nn.Module):
    """A transformers causal LM as the trainer drives it: token ids in, logits out."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    @property
    def blocks(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def hf_config(family: str, cfg, kv_heads: int):
    """The transformers config of ``family`` with the sizes of ``cfg`` (a ModelConfig)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    return cls(vocab_size=cfg.vocab, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
               num_attention_heads=cfg.n_heads, num_key_value_heads=kv_heads or cfg.n_heads,
               intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_seq, tie_word_embeddings=False)


def build(cfg) -> nn.Module:
    """The model of ``cfg`` (a TrainConfig) with the same initial weights on every rank: from ``seed``,
    or the Hugging Face directory ``init_from`` (its own config, so nothing in it is lost: rope base,
    norm epsilon, tied embeddings). Activation checkpointing is transformers' own (non-reentrant, so it
    composes with FSDP2 and DTensor)."""
    if cfg.family == "reference":
        from serving.model import init_model
        return init_model(cfg.model, cfg.seed)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        lm = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        lm = AutoModelForCausalLM.from_config(hf_config(cfg.family, cfg.model, cfg.kv_heads), dtype=torch.float32)
    if cfg.activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return HFCausalLM(lm)


def tp_plan(family: str) -> dict[str, str]:
    return TP_PLANS["reference" if family == "reference" else "hf"]
