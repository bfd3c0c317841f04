"""The reference model: a small decoder-only transformer (real attention), sized to any target."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from serving.model_config import ModelConfig


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections, so tensor parallelism can
    split q, k and v by columns (whole heads per rank) and o by rows. The number of heads is read from
    the width it is given: under tensor parallelism each rank runs only its own heads, unchanged."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.head_dim = c.d_model // c.n_heads
        self.wq = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wk = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wv = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wo = nn.Linear(c.d_model, c.d_model, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(), nn.Linear(c.d_ff, c.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
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
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def init_model(c: ModelConfig, seed: int) -> TinyTransformer:
    g = torch.Generator().manual_seed(seed)
    m = TinyTransformer(c)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()
