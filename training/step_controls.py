"""What shapes each optimizer step besides the gradient: the learning-rate schedule, gradient clipping
and the compute precision.

- The learning rate is a pure function of the step (``lr_at``): linear warm-up over ``warmup_steps``,
  then constant or a cosine decay to ``min_lr_ratio × lr`` at the last step. Nothing to checkpoint,
  so a resumed run continues on the same curve.
- Clipping scales the gradients so their global L2 norm is at most ``grad_clip``: over every rank's
  shards under FSDP and tensor parallelism (a DTensor norm, made whole), the replicated gradients
  under DDP (already averaged, so every rank computes the same norm).
- ``bf16``: the forward runs in bfloat16 with fp32 master weights and fp32 gradients: FSDP2 through
  its ``MixedPrecisionPolicy`` (bf16 parameters gathered, fp32 gradient reduction), the other layouts
  under ``torch.autocast``. The loss is computed from fp32 logits.
"""
from __future__ import annotations

import contextlib
import math

import torch


def lr_at(cfg, step: int) -> float:
    """The learning rate of step ``step`` (0-based) of ``cfg`` (a TrainConfig)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    done = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.lr * cfg.min_lr_ratio
    return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * done))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def clip_gradients(params, max_norm: float) -> float:
    """Clip to ``max_norm`` (global L2 norm over all shards); returns the norm before clipping. Under
    tensor parallelism some gradients are DTensors (split blocks) and some plain tensors (replicated
    embeddings and norms, the same on every rank): each kind's norm is taken apart, then combined."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if hasattr(g, "full_tensor")]
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    square = 0.0
    if sharded:                                    # a DTensor norm: over every rank's shards
        square += float(torch.nn.utils.get_total_norm(sharded, 2.0).full_tensor()) ** 2
    if plain:
        square += float(torch.nn.utils.get_total_norm(plain, 2.0)) ** 2
    total = math.sqrt(square)
    scale = max_norm / (total + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return total


def forward_precision(cfg, device: torch.device):
    """The context a forward runs in: autocast to bf16, or nothing (fp32, or FSDP's own policy)."""
    if cfg.precision == "bf16" and cfg.layout not in ("fsdp", "fsdp_tp"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fsdp_policy(cfg):
    """FSDP2's mixed-precision policy for ``cfg`` (None: full precision)."""
    if cfg.precision != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
