"""One rank process: join the process group, build the model for its layout, train, write its record.

The per-step loop never leaves this process (no control plane): make this rank's share of the batch,
forward, backward (DDP reduces the gradient buckets through the selected comm hook while backward runs;
FSDP/TP/PP run their own collectives), optimiser step, outer synchronisation every H steps for
local_sgd/diloco, rate exchange when rebalancing, sampler advance.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lib.atomic import write_atomic
from training.models import build as build_model
from training.step_controls import clip_gradients, forward_precision, lr_at, set_lr
from training.balance import Balancer
from training.comm_time import CommTimer
from training.checkpoint import Checkpointer, latest
from training.control import agree
from training.comm import HOOKS, CommState, OuterSync, reduce_after_backward
from training.config import TrainConfig
from training.data import Sampler, source_for
from training.layouts import full_state_dict, placement, wrap
from training.pipeline import Pipeline
from training.wire_bytes import tcp_bytes_sent

# what a rank imports lazily, for the servers ranks fork from to import once instead: DDP's constructor
# imports torch._dynamo (0.5-0.9 s here, most of a small model's restart), checkpoint loading DCP's
# state-dict helpers, and a Llama-family model transformers' modeling code (1.5 CPU-s a rank)
RANK_IMPORTS = ("torch._dynamo", "torch.distributed.checkpoint.state_dict", "torch.nn.parallel")
HF_MODEL_IMPORTS = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                    "transformers.models.mistral.modeling_mistral")
BACKWARD_OVER_FORWARD = 2.0     # backward costs about twice the forward (FLOPs): for the speed estimate


def device_for(rank: int) -> torch.device:
    """CUDA when present (one GPU per rank, round robin), the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()                  # the loss in fp32 whatever the forward ran in
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, source=None) -> float:
    """The loss of these weights on a fixed batch no step trains on: the same number for the same
    final weights however the run got there (interruptions, recoveries, world size)."""
    ids = (source or source_for(cfg)).held_out(cfg.global_batch, cfg.seq_len).to(device)
    return lm_loss(model, ids).item()


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds: its shards under FSDP/TP, everything otherwise."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p          # a DTensor's own shard
        total += local.numel() * local.element_size()
    return total


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def leave(alive: tuple = ()) -> None:
    """End a finished rank process while ``alive`` (what ``run_rank`` returned) is still referenced.
    Its record and weights are on disk and the process group is gone; leave without interpreter
    finalization or freeing those objects: native objects (a DDP reducer still holding the gloo group,
    its worker threads) torn down were seen to abort a finished rank ("terminate called without an
    active exception") or to deadlock it (see the end of ``run_rank``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_progress(path: Path, progress: dict) -> None:
    write_atomic(path, json.dumps(progress))


def run_rank(rank: int, cfg_dict: dict, out_dir: str, durable: dict | None = None) -> tuple:
    """``durable`` (a supervised run, training/supervised_rank.py): ``init_method`` for the process
    group, ``collective_timeout_s``, ``checkpoints`` (a directory), ``every`` (steps between
    checkpoints), ``synchronous`` (block on saves, for comparison) and ``progress`` (a JSON file this
    rank rewrites after every step). The rank resumes from the newest complete checkpoint."""
    cfg = TrainConfig.from_dict(cfg_dict)
    world = cfg.world_size
    # where a (re)start spends its time, in the progress file: spec read, group formed, state loaded
    startup = {"spec": durable.get("t_spec", time.time())} if durable else {}
    device = device_for(rank)
    if device.type == "cpu":         # ranks share the machine's cores: no oversubscription
        torch.set_num_threads(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(cfg.seed)
    if world > 1:
        # a local job meets through a file in its directory (no port to pick); a supervised one
        # through the TCP address its workflow handed out, with a bound on any one collective
        init = durable["init_method"] if durable else f"file://{Path(out_dir, 'rendezvous').resolve()}"
        timeout = timedelta(seconds=durable.get("collective_timeout_s", 60)) if durable else None
        startup["join"] = time.time()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                init_method=init, **({"timeout": timeout} if timeout else {}))
    startup["group"] = time.time()
    place = placement(cfg, rank)
    model = build_model(cfg).train().to(device)   # same on every rank
    state = CommState(cfg.comm, place.dp_size, cfg.topk_ratio, cfg.powersgd_rank)
    pipe = Pipeline(cfg, model, rank, device) if cfg.layout == "pp" and world > 1 else None
    if pipe is None:
        model = wrap(cfg, model, device, state, HOOKS[cfg.comm])
    core = pipe.module if pipe else getattr(model, "module", model)
    opt = make_optimizer(cfg, core.parameters())
    outer = (OuterSync(cfg.comm, core, state, cfg.outer_lr, cfg.outer_momentum)
             if cfg.comm in ("local_sgd", "diloco") and world > 1 else None)
    balancer = Balancer(cfg.global_batch, place.dp_size) if cfg.rebalance and world > 1 else None
    sampler = Sampler(source_for(cfg), cfg.global_batch, cfg.seq_len)
    slowdown = cfg.slowdown(rank)
    ckpt, start, stalls = None, 0, []
    if durable:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def train_state() -> dict:
            msd, osd = get_state_dict(pipe.module if pipe else model, opt)
            return {"model": msd, "optim": osd, "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}

        startup["model"] = time.time()
        ckpt = Checkpointer(Path(durable["checkpoints"]), rank, world, local=durable.get("local_checkpoints", False))
        startup["ckpt_group"] = time.time()
        found = latest(Path(durable["checkpoints"]), ckpt.group, shared=not ckpt.local)
        startup["verified"] = time.time()
        if found:
            snap = train_state()
            startup["state"] = time.time()
            ckpt.load(found.path, snap)
            startup["read"] = time.time()
            set_state_dict(pipe.module if pipe else model, opt, model_state_dict=snap["model"],
                           optim_state_dict=snap["optim"])
            sampler.load_state_dict(snap["sampler"])
            torch.set_rng_state(snap["rng"])
            start = ckpt.last_complete = sampler.next_step
        ckpt.set_aside_after(start)
        startup["loaded"] = time.time()
    losses, sent, step_s, samples, evals = [], [], [], [], []
    # one step in every log_every profiled for its communication time (kineto's own lines to a side file)
    comm = CommTimer(cfg.log_every, device, first=start + 2, log=str(Path(out_dir, f"rank{rank}.profiler.log")))

    def report(step: int, loss: float | None, seconds: float | None) -> None:
        _write_progress(Path(durable["progress"]), {
            "step": step, "loss": loss, "step_s": seconds, "last_checkpoint": ckpt.last_complete,
            "first_step": start, "save_stall_s": sum(stalls), "saves": len(stalls), "t": time.time(),
            "pid": os.getpid(), "startup": startup,
            "tokens": samples[-1] * (cfg.seq_len - 1) if samples else None,        # this rank's, last step
            # the share of the newest profiled step some collective was in flight (training/comm_time.py)
            "comm_fraction": comm.samples[-1][1] / comm.samples[-1][2] if comm.samples else None})
    paused, seen, last_save = False, 0, time.monotonic()
    if durable:
        report(start, None, None)                     # resumed (or started): the supervisor sees where
    # operator requests travel on their own group: the checkpoint group is busy in the background save's
    # thread, and the training group may be NCCL (the request is a CPU tensor)
    ctl_group = dist.new_group(backend="gloo") if durable and durable.get("control") and world > 1 else None
    if durable and durable.get("control"):
        seen = agree(Path(durable["control"]), rank, ctl_group).checkpoint_seq   # requests already served
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        probe = contextlib.ExitStack()
        probe.enter_context(comm.around(step))
        before = state.sent_bytes
        shares = balancer.shares() if balancer else sampler.shares(place.dp_size)
        mine = shares[place.dp_rank]
        ids = sampler.batch(place.dp_rank, place.dp_size, shares).to(device)
        opt.zero_grad(set_to_none=True)
        if pipe is not None:
            with forward_precision(cfg, device):
                loss = pipe.step(ids)
        else:
            # overlap=false: DDP decides at forward time whether backward reduces, so no_sync covers both
            with contextlib.nullcontext() if cfg.overlap else model.no_sync(), forward_precision(cfg, device):
                loss_t = lm_loss(model, ids)
            mean_loss = loss_t.detach()                          # this share's mean, reported unweighted
            t_fwd = time.perf_counter() - t0                      # making the share and its forward
            work = t_fwd * (1 + BACKWARD_OVER_FORWARD)           # this rank's compute, without any waiting
            if slowdown > 1:                                     # an injected slow rank (config slow_ranks)
                time.sleep((slowdown - 1) * work)
                work *= slowdown
            if balancer:
                loss_t = loss_t * Balancer.loss_weight(mine, place.dp_size, cfg.global_batch)
            if cfg.overlap:
                loss_t.backward()
            else:
                with model.no_sync():
                    loss_t.backward()
                reduce_after_backward(core, state)
            loss = mean_loss.item()
        if ckpt is not None and ckpt.staging is not None:   # a background save's copy must be done first
            stalls[-1] += ckpt.before_update()
        if cfg.grad_clip:
            clip_gradients(list(core.parameters()), cfg.grad_clip)
        set_lr(opt, lr_at(cfg, step))
        opt.step()
        if outer and (step + 1) % cfg.sync_every == 0:
            outer.sync()
        if balancer:
            balancer.observe(mine, work)
        sampler.advance()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        probe.close()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
        if not durable and loss is not None and rank == (world - 1 if cfg.layout == "pp" else 0):
            with open(Path(out_dir, "progress.jsonl"), "a") as f:     # one line a step, for launch's watcher
                f.write(json.dumps({"step": step + 1, "loss": loss, "step_s": step_s[-1], "t": time.time(),
                                    "comm_s": comm.samples[-1][1] if comm.samples else None}) + "\n")
        sent.append(state.sent_bytes - before)
        samples.append(mine)
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            # every rank: a collective under fsdp/tp (after the step's timing: not training work)
            evals.append((step + 1, held_out_loss(core, cfg, device, sampler.source)))
        if durable:
            ckpt.poll()
            every_s = durable.get("every_s") or 0
            ctl = (agree(Path(durable["control"]), rank, ctl_group, bool(every_s) and time.monotonic() - last_save >= every_s)
                   if durable.get("control") else None)
            due = (step + 1) % durable["every"] == 0 or bool(ctl and ctl.time_due)
            if ctl and ctl.checkpoint_seq > seen:          # checkpoint-now from the operator
                seen, due = ctl.checkpoint_seq, True
            if due and step + 1 < cfg.steps and not (ctl and ctl.pause):
                t_save = time.perf_counter()       # the stall: collecting the state and handing it over
                ckpt.save(step + 1, train_state(), asynchronous=not durable.get("synchronous"))
                stalls.append(time.perf_counter() - t_save)
                last_save = time.monotonic()
            report(step + 1, loss, step_s[-1])
            if ctl and ctl.pause and step + 1 < cfg.steps:
                paused = True
                break
    eval_loss = None
    if durable:
        # the final (or paused-at) state, complete before the process reports success
        ckpt.save(sampler.next_step, train_state(), asynchronous=False)
        ckpt.wait()                         # and marked complete (every rank's digests merged)
        if pipe is None and not paused:
            eval_loss = held_out_loss(core, cfg, device, sampler.source)   # the corpus is not hashed again
    # DDP hooks count every byte of gradient traffic; FSDP/TP/PP collectives are torch's own
    counted = cfg.layout == "ddp" or world == 1
    record = {"rank": rank, "device": str(device), "losses": losses if place.reports_loss else None,
              "sent_bytes": sent if counted else None, "step_s": step_s, "samples": samples,
              "rates": balancer.rates if balancer else None, "next_step": sampler.next_step,
              "first_step": start, "save_stall_s": stalls, "held_out_loss": eval_loss, "paused": paused,
              "param_bytes": _local_bytes(core), "comm_samples": comm.samples, "eval_losses": evals}
    full = pipe.full_state_dict() if pipe else full_state_dict(model, cfg)   # a collective: every rank calls it
    # the whole run's traffic, the gathering of the final weights included, while the connections are open
    record["wire_bytes_sent"] = tcp_bytes_sent(os.getpid()) if world > 1 else 0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(full, Path(out_dir, "model.pt"))
    if world > 1:
        # every rank done before any tears its connections down: a peer closing first made gloo's
        # receive thread throw (std::terminate, SIGABRT) on a slow (tc-limited) link
        dist.barrier()
        dist.destroy_process_group()
    # The caller holds these until it leaves the process (``leave``). Freed here, the DDP reducer's
    # destructor would destroy the last gloo group on this thread, holding the GIL, and join gloo's
    # worker thread, which needs the GIL to free a finished work item: a deadlock (found with py-spy
    # on a rank that never exited).
    return model, pipe, opt, ckpt
