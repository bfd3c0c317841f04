"""The parallelism layouts: where a rank sits on the device mesh and how the model is wrapped for it.

- ddp: every rank holds the whole model; gradient buckets are reduced by a comm hook during backward.
- fsdp: FSDP2 ``fully_shard`` per block (ZeRO-3: parameters, gradients, optimiser state sharded).
- tp: Megatron-style tensor parallelism on a 1-D mesh: q/k/v and the MLP's first linear split by
  columns (whole heads per rank), o and the MLP's second linear by rows, so each block needs one
  all-reduce in forward and one in backward. Embeddings, norms and the head stay replicated.
- fsdp_tp: 2-D mesh (dp, tp): tensor parallel inside each tp group, FSDP2 over the dp dimension.
- pp: pipeline stages, one per rank (training/pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from training.config import TrainConfig
from training.models import tp_plan
from training.step_controls import fsdp_policy


@dataclass(frozen=True)
class Placement:
    dp_rank: int
    dp_size: int
    reports_loss: bool          # one rank per data-parallel share reports its loss (tp rank 0, last pp stage)


def placement(cfg: TrainConfig, rank: int) -> Placement:
    if cfg.layout in ("ddp", "fsdp"):
        return Placement(rank, cfg.world_size, True)
    if cfg.layout == "fsdp_tp":
        return Placement(rank // cfg.tp_degree, cfg.dp_size(), rank % cfg.tp_degree == 0)
    if cfg.layout == "tp":
        return Placement(0, 1, rank == 0)
    if cfg.layout == "pp":
        return Placement(0, 1, rank == cfg.world_size - 1)
    return Placement(0, 1, True)


def mesh_for(cfg: TrainConfig, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    if cfg.layout == "fsdp_tp":
        return init_device_mesh(device.type, (cfg.dp_size(), cfg.tp_degree), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device.type, (cfg.world_size,), mesh_dim_names=(cfg.layout,))


def tensor_parallel(model: torch.nn.Module, tp_mesh, family: str = "reference") -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    kinds = {"col": ColwiseParallel, "row": RowwiseParallel}
    plan = {name: kinds[kind]() for name, kind in tp_plan(family).items()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def shard_fully(model: torch.nn.Module, dp_mesh=None, mp_policy=None) -> None:
    """FSDP2 (ZeRO-3): each transformer block is one unit whose parameters, gradients and optimiser
    state are sharded over the data-parallel ranks and gathered only around its own forward and backward
    (in bf16 with ``mp_policy``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place (parameter names unchanged), as torchtitan does: after
    tensor parallelism, before FSDP wraps the layers."""
    for block in model.blocks:
        block.compile()


def wrap(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, comm_state, hook) -> torch.nn.Module:
    """The model as this rank trains it (pp is built by training/pipeline.py instead). The order is
    torchtitan's: tensor parallel, (activation checkpointing, set when the model was built), compile, FSDP."""
    if cfg.world_size == 1 or cfg.layout == "single":
        if cfg.compile:
            compile_blocks(model)
        return model
    if cfg.compile and cfg.layout in ("ddp", "fsdp"):
        compile_blocks(model)
    if cfg.layout == "ddp":
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_mb)
        ddp.register_comm_hook(comm_state, hook)
        return ddp
    if cfg.layout == "fsdp":
        shard_fully(model, mp_policy=fsdp_policy(cfg))
    elif cfg.layout == "tp":
        tensor_parallel(model, mesh_for(cfg, device), cfg.family)
        if cfg.compile:
            compile_blocks(model)
    elif cfg.layout == "fsdp_tp":
        mesh = mesh_for(cfg, device)
        tensor_parallel(model, mesh["tp"], cfg.family)
        if cfg.compile:
            compile_blocks(model)
        shard_fully(model, mesh["dp"], fsdp_policy(cfg))
    return model


def full_state_dict(model: torch.nn.Module, cfg: TrainConfig) -> dict:
    """The whole model's weights on the CPU, gathered from shards; a collective under fsdp/tp/fsdp_tp:
    every rank calls it."""
    if cfg.layout in ("fsdp", "tp", "fsdp_tp") and cfg.world_size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    core = model.module if isinstance(model, DDP) else model
    return {k: v.detach().cpu() for k, v in core.state_dict().items()}
