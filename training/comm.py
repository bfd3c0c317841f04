"""Gradient communication methods as DDP comm hooks, each counting the bytes it hands to the process
group (the payload of every collective this rank calls: what it sends into the group, whatever
algorithm the backend then runs). One code path for gloo and NCCL: plain collectives only.

- allreduce: the baseline (fp32 all-reduce of each bucket, averaged).
- fp16: the bucket all-reduced in half precision (half the bytes).
- int8_ef: each rank sends its bucket as int8 with one fp32 scale; the quantisation error is kept and
  added to the next step's gradient (error feedback), so nothing is lost, only delayed.
- topk_ef: each rank sends the k largest-magnitude entries (values and int32 indices); the rest stays
  in the error-feedback residual.
- local_sgd: no gradient traffic; parameters are averaged every ``sync_every`` steps (``average_params``).

(No ``from __future__ import annotations`` here: DDP checks the hooks' annotations at run time.)
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommState:
    method: str
    world: int
    topk_ratio: float = 0.01
    sent_bytes: int = 0                                   # payload handed to the process group, running total
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def count(self, *tensors: torch.Tensor) -> None:
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def residual(self, bucket_index: int, like: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(bucket_index)
        if r is None or r.shape != like.shape:           # DDP may rebuild its buckets after step 1
            r = self.residuals[bucket_index] = torch.zeros_like(like)
        return r


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    state.count(buf)
    work = dist.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda f: f.value()[0].div_(state.world))


def fp16_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    half = buf.to(torch.float16)
    state.count(half)
    work = dist.all_reduce(half, async_op=True)

    def back(f):
        buf.copy_(f.value()[0].to(buf.dtype)).div_(state.world)
        return buf
    return work.get_future().then(back)


def _gather_then(state: CommState, payload: torch.Tensor, combine) -> torch.futures.Future[torch.Tensor]:
    """One all_gather of this rank's payload (one collective per bucket: nothing waits inside a callback),
    then ``combine(list of every rank's payload)`` into the averaged bucket."""
    parts = [torch.empty_like(payload) for _ in range(state.world)]
    state.count(payload)
    work = dist.all_gather(parts, payload, async_op=True)
    return work.get_future().then(lambda _: combine(parts))


def int8_ef_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    x = buf.float() + state.residual(bucket.index(), buf).float()
    scale = (x.abs().max() / 127.0).clamp_min(1e-30).reshape(1)
    q = torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8)
    state.residuals[bucket.index()] = (x - q.float() * scale).to(buf.dtype)    # what int8 could not carry
    payload = torch.cat([q, scale.view(torch.int8)])                            # n int8 + the fp32 scale's 4 bytes

    def combine(parts):
        total = torch.zeros_like(x)
        for p in parts:
            total.add_(p[:-4].float() * p[-4:].view(torch.float32))
        return buf.copy_(total.div_(state.world))
    return _gather_then(state, payload, combine)


def topk_ef_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    x = buf.float() + state.residual(bucket.index(), buf).float()
    k = max(1, math.ceil(state.topk_ratio * x.numel()))
    idx = torch.topk(x.abs(), k, sorted=False).indices
    rest = x.clone()
    rest[idx] = 0
    state.residuals[bucket.index()] = rest.to(buf.dtype)                        # sent later, not lost
    payload = torch.cat([x[idx], idx.to(torch.int32).view(torch.float32)])      # k values, k int32 indices

    def combine(parts):
        total = torch.zeros_like(x)
        for p in parts:
            total.index_add_(0, p[k:].view(torch.int32).long(), p[:k])
        return buf.copy_(total.div_(state.world))
    return _gather_then(state, payload, combine)


def no_sync_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """local_sgd: each rank steps on its own gradient; ``average_params`` syncs every H steps."""
    return _done(bucket.buffer())


HOOKS = {"allreduce": allreduce_hook, "fp16": fp16_hook, "int8_ef": int8_ef_hook, "topk_ef": topk_ef_hook,
         "local_sgd": no_sync_hook}


@torch.no_grad()
def average_params(module: torch.nn.Module, state: CommState) -> None:
    """Local SGD's outer step: every parameter replaced by its mean over the ranks (flattened, one call)."""
    params = [p for p in module.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    state.count(flat)
    dist.all_reduce(flat)
    flat.div_(state.world)
    off = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[off:off + n].view_as(p))
        off += n
