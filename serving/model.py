"""The reference model: a small decoder-only transformer (real attention), sized to any target."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq: int = 64

    def to_dict(self) -> dict:
        return asdict(self)

    def param_count(self) -> int:
        per_layer = 4 * self.d_model * self.d_model + 2 * self.d_model * self.d_ff + 4 * self.d_model + self.d_ff + self.d_model
        return self.vocab * self.d_model * 2 + self.max_seq * self.d_model + self.n_layers * per_layer + 2 * self.d_model

    @classmethod
    def for_size(cls, target_bytes: int, dtype_bytes: int = 4) -> "ModelConfig":
        """The smallest config of this family whose fp32 weights reach ``target_bytes``."""
        d = 64
        while True:
            cfg = cls(vocab=512, d_model=d, n_layers=max(2, min(24, d // 64)), n_heads=max(1, d // 64),
                      d_ff=4 * d, max_seq=64)
            if cfg.param_count() * dtype_bytes >= target_bytes or d >= 16384:
                return cfg
            d += 64


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = nn.MultiheadAttention(c.d_model, c.n_heads, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(), nn.Linear(c.d_ff, c.d_model))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.ff(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.max_seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), -math.inf, device=ids.device), diagonal=1)
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


def init_model(c: ModelConfig, seed: int) -> TinyTransformer:
    g = torch.Generator().manual_seed(seed)
    m = TinyTransformer(c)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()
