"""Pipeline parallelism with ``torch.distributed.pipelining``: the model cut into one stage per rank over
its decoder layers (embeddings with the first layers, the final norm and head with the last), trained
by a GPipe or 1F1B schedule over ``microbatches`` microbatches. Each stage keeps the full model's
parameter names, so the stages' state dicts merge back into the single-process model's."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from training.config import TrainConfig


def block_ranges(n_layers: int, stages: int) -> list[range]:
    """Blocks per stage, as even as possible (earlier stages take the extra one)."""
    base, extra = divmod(n_layers, stages)
    out, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


class Stage(nn.Module):
    """Part of a TinyTransformer: names like ``blocks.3.attn.wq.weight`` are kept from the whole model."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos = model.embed, model.pos
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks.values():
            x = b(x)
        return self.head(self.ln_f(x)) if self.last else x


class HFStage(nn.Module):
    """Part of a transformers Llama-family model (training/models.py's HFCausalLM): names like
    ``lm.model.layers.3.self_attn.q_proj.weight`` are kept. Every stage holds the rotary table (no
    parameters) and builds the causal mask the way the whole model does."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        whole = model.lm
        self.config = whole.config
        self.lm = nn.Module()
        self.lm.model = nn.Module()
        inner = self.lm.model
        if first:
            inner.embed_tokens = whole.model.embed_tokens
        inner.rotary_emb = whole.model.rotary_emb
        inner.layers = nn.ModuleDict({str(i): whole.model.layers[i] for i in blocks})
        if last:
            inner.norm, self.lm.lm_head = whole.model.norm, whole.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        inner = self.lm.model
        h = inner.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        rotary = inner.rotary_emb(h, position_ids=pos)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=pos)
        return self.lm.lm_head(inner.norm(h)) if self.last else h


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


class Pipeline:
    def __init__(self, cfg: TrainConfig, model: nn.Module, rank: int, device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        n = cfg.world_size
        self.rank, self.n = rank, n
        kind = Stage if cfg.family == "reference" else HFStage
        self.module = kind(model, block_ranges(cfg.model.n_layers, n)[rank], rank == 0, rank == n - 1).to(device)
        stage = PipelineStage(self.module, rank, n, device)
        schedule = ScheduleGPipe if cfg.pp_schedule == "gpipe" else Schedule1F1B
        # scale_grads: each microbatch's mean loss contributes 1/microbatches, so the gradient is the
        # mean over the whole batch, as in one process
        self.schedule = schedule(stage, n_microbatches=cfg.microbatches, loss_fn=_lm_loss, scale_grads=True)

    def step(self, ids: torch.Tensor) -> float | None:
        """Forward and backward of one global batch through all stages; the loss on the last stage."""
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        if self.rank == 0:
            self.schedule.step(inputs)
        elif self.rank == self.n - 1:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=targets, losses=losses)
            return float(torch.stack([loss.detach() for loss in losses]).mean())
        else:
            self.schedule.step()
        return None

    def full_state_dict(self) -> dict:
        """Every stage's weights merged (a collective: every stage calls it)."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        parts: list[dict | None] = [None] * self.n
        dist.all_gather_object(parts, mine)
        return {k: v for p in parts for k, v in p.items()}
