"""Model FLOPs utilisation: what a step should cost and what this machine can do.

- ``flops_per_token``: torchtitan's count, ``6 N + 12 L d T`` (N the parameters a token passes through,
  the input embedding excluded as a lookup; the second term the attention scores and their use over a
  ``T``-token context). Forward and backward, no recomputation: activation checkpointing's extra
  forward is cost, not useful work.
- ``matmul_peak``: the machine's measured matmul rate in the dtype the run computes in (square
  matmuls, best of several rounds), with the threads the run's ranks use between them. MFU is the
  job's useful FLOPs per second over that bound, measured in the same run.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def flops_per_token(cfg) -> float:
    """Forward + backward FLOPs of one token of ``cfg`` (a TrainConfig) at context ``seq_len - 1``."""
    m = cfg.model
    d, L, ff, V = m.d_model, m.n_layers, m.d_ff, m.vocab
    if cfg.family == "reference":
        per_layer = 4 * d * d + 2 * d * ff
    else:
        kv = (cfg.kv_heads or m.n_heads) * (d // m.n_heads)
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff          # q, o; k, v; gate, up, down
    params = L * per_layer + V * d                                # + the output head
    return 6 * params + 12 * L * d * (cfg.seq_len - 1)


def model_parallel_degree(cfg) -> int:
    """How many ranks share each token's FLOPs: tensor-parallel ranks split every layer, pipeline
    stages the layers; data-parallel ranks each do all of their own tokens'."""
    return cfg.world_size if cfg.layout == "pp" else cfg.tensor_degree()


def matmul_peak(device: "torch.device", dtype: "torch.dtype | None" = None, threads: int = 0,
                seconds: float = 1.0) -> float:
    """FLOP/s of the best round of square matmuls on ``device`` in ``dtype`` (default float32), with
    ``threads`` CPU threads (0: as set), over about ``seconds``, and at least one round after a first
    call whatever that takes. torch is imported here: the FLOP count above needs none."""
    import torch
    dtype = dtype or torch.float32
    n = 4096 if device.type == "cuda" else 1024
    saved = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)

        def timed(reps: int) -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return reps * 2 * n ** 3 / (time.perf_counter() - t0)

        end = time.perf_counter() + seconds
        timed(1)                                                  # first call: allocation, kernel choice
        # one round at least, however slow: a dtype this device only emulates (bf16 on a CPU without
        # AVX-512 BF16 or AMX) takes seconds a call, longer than the whole budget
        best = timed(1)
        while time.perf_counter() < end:
            best = max(best, timed(4))
        return best
    finally:
        torch.set_num_threads(saved)
