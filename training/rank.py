"""One rank process: build the model, join the process group, train, write this rank's record.

The per-step loop never leaves this process (no control plane): forward, backward (DDP reduces the
gradient buckets through the selected comm hook while backward runs), optimiser step, sampler advance.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from serving.model import init_model
from training.comm import HOOKS, CommState, average_params
from training.config import TrainConfig
from training.data import Language, Sampler


def device_for(rank: int) -> torch.device:
    """CUDA when present (one GPU per rank, round robin), the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def shard_fully(model: torch.nn.Module) -> None:
    """FSDP2 (ZeRO-3): each transformer block is one unit whose parameters, gradients and optimiser
    state are sharded over the ranks and gathered only around its own forward and backward."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def full_state_dict(model: torch.nn.Module, layout: str, world: int) -> dict:
    """The whole model's weights on the CPU (gathered from the shards under fsdp)."""
    if layout == "fsdp" and world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    core = model.module if isinstance(model, DDP) else model
    return {k: v.detach().cpu() for k, v in core.state_dict().items()}


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def run_rank(rank: int, cfg_dict: dict, out_dir: str) -> None:
    cfg = TrainConfig.from_dict(cfg_dict)
    world = cfg.world_size
    device = device_for(rank)
    torch.manual_seed(cfg.seed)
    if world > 1:
        # rendezvous through a file in the job's directory: no port to pick, nothing to collide with
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                init_method=f"file://{Path(out_dir, 'rendezvous').resolve()}")
    model = init_model(cfg.model, cfg.seed).train().to(device)
    state = CommState(cfg.comm, world, cfg.topk_ratio)
    if cfg.layout == "ddp" and world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=cfg.bucket_mb)
        model.register_comm_hook(state, HOOKS[cfg.comm])
    elif cfg.layout == "fsdp" and world > 1:
        shard_fully(model)
    opt = make_optimizer(cfg, model.parameters())
    sampler = Sampler(Language(cfg.model.vocab, cfg.data_seed), cfg.global_batch, cfg.seq_len)
    losses, sent, step_s = [], [], []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        before = state.sent_bytes
        ids = sampler.batch(rank, world).to(device)
        loss = lm_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cfg.comm == "local_sgd" and world > 1 and (step + 1) % cfg.sync_every == 0:
            average_params(model.module if isinstance(model, DDP) else model, state)
        sampler.advance()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        sent.append(state.sent_bytes - before)
    counted = cfg.layout != "fsdp"       # FSDP2's own collectives are not behind our counting hooks
    record = {"rank": rank, "device": str(device), "losses": losses, "sent_bytes": sent if counted else None,
              "step_s": step_s,
              "samples_per_step": sampler.shares(world)[rank], "next_step": sampler.next_step}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    full = full_state_dict(model, cfg.layout, world)       # a collective under fsdp: every rank calls it
    if rank == 0:
        torch.save(full, Path(out_dir, "model.pt"))
    if world > 1:
        # every rank done before any tears its connections down: a peer closing first made gloo's
        # receive thread throw (std::terminate, SIGABRT) on a slow (tc-limited) link
        dist.barrier()
        dist.destroy_process_group()
