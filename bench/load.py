"""`weightcast bench load`: load throughput against the page-cache read throughput of the same files.

Both are measured in one run on the same checkpoint (files already in the page cache), so the ratio
is meaningful on a noisy machine. A load counts only work that leaves the weights usable: every byte
read, hashed against the signed manifest's chunk digests, and resident as tensors on the device
(CUDA: copied and synchronised); the smoke test is timed apart. On a GPU the host-to-device copy
throughput is reported too. The hash bound is the load's own ceiling, measured in the same run: one
core's hash rate over a chunk-sized buffer times the threads the loader hashes with (and no more than
the cores there are); a load cannot verify faster than that.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peerd import digests, manifest as mf
from peerd.store import ChunkStore
from serving.checkpoint import write_checkpoint
from serving.loader import load_model, pick_device
from serving.model_config import ModelConfig
from serving.verified_read import VerifiedFiles


def _store_version(src: Path, store_root: Path, version: str, chunk_size: int, algorithm: str,
                   serving: dict | None = None) -> Path:
    """Lay the checkpoint out as peerd would have: in its store, chunk by chunk, with manifest and
    verified.json (signed with a throwaway key: the loader checks digests, the rollout signatures)."""
    m = mf.build_from_directory(src, "bench", version, chunk_size=chunk_size, algorithm=algorithm, serving=serving)
    vs = ChunkStore(store_root).open_version(m, mf.signed_bytes(m, Ed25519PrivateKey.generate()))
    vs.import_files(src)
    vs.write_verified()
    vs.close()
    return vs.model_dir


def _read_all(d: Path) -> int:
    n = 0
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(16 << 20)
            while k := f.readinto(buf):
                n += k
    return n


def _h2d_gbps(nbytes: int) -> float | None:
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def _hash_gbps(algorithm: str, nbytes: int = 256 << 20, block: int = 64 << 20) -> float:
    """One core's hash rate (GB/s) over ``nbytes`` fed in ``block``-sized pieces, best of three."""
    buf = memoryview(bytearray(block))
    best = 0.0
    for _ in range(3):
        h = digests.new(algorithm)
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            h.update(buf)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def _reference(work: Path, size: int, chunk_size: int, algorithm: str):
    """weightcast's reference transformer of ``size`` bytes, and how to load it (bytes, seconds)."""
    cfg = ModelConfig.for_size(size)
    src = write_checkpoint(work / "ckpt", cfg, seed=1, shard_bytes=512 << 20, version="bench")
    d = _store_version(src, work / "store", "bench", chunk_size, algorithm)
    shutil.rmtree(src)
    device = pick_device()

    def load() -> tuple[int, float]:
        r = load_model(d, "bench", device)
        return r.nbytes, r.seconds
    return d, cfg.to_dict(), device, load


def _llama(work: Path, size: int, chunk_size: int, algorithm: str):
    """A Hugging Face Llama directory of about ``size`` bytes (bf16, random weights, 256 MB shards) on
    the transformers engine: verified read, model built on the verified tensors, resident on the
    device (its golden check is not timed: random weights have none to pass)."""
    from serving import hf_build
    from serving.engine import VersionKey
    from serving.hf_engine import TransformersEngine
    shape = hf_build.size_for_bytes(size)
    src = hf_build.build("llama", work / "ckpt", size=shape, train_steps=0, max_shard_size="256MB")
    d = _store_version(src, work / "store", "bench", chunk_size, algorithm, serving={"golden": {"prompts": []}})
    shutil.rmtree(src)
    engine = TransformersEngine(kv_cache_tokens=0)

    def load() -> tuple[int, float]:
        t0 = time.perf_counter()
        loaded, _ = engine.build(VersionKey("bench", "bench"), d)
        return loaded.nbytes, time.perf_counter() - t0
    return d, {"architecture": "llama", **shape.__dict__}, engine._device, load


def run_load_bench(size: int, repeats: int = 3, workdir: Path | None = None, chunk_size: int = 64 << 20,
                   algorithm: str = mf.HASH_ALGORITHM, engine: str = "reference") -> dict:
    work = Path(workdir or tempfile.mkdtemp(prefix="wc-load-"))
    try:
        d, model, device, load = (_llama if engine == "transformers" else _reference)(work, size, chunk_size,
                                                                                       algorithm)
        nbytes = _read_all(d)                        # warm the page cache
        load()                                       # warm torch (first-call initialisation)
        reads, loads = [], []
        for _ in range(repeats):                     # interleaved, so both see the same machine state
            t0 = time.perf_counter()
            _read_all(d)
            reads.append(nbytes / (time.perf_counter() - t0) / 1e9)
            n, seconds = load()
            loads.append(n / seconds / 1e9)
        read_gbps, load_gbps = max(reads), max(loads)
        threads = min(VerifiedFiles.default_threads(), os.cpu_count() or 1)
        core_gbps = _hash_gbps(algorithm)
        hash_bound = core_gbps * threads
        return {"size_bytes": nbytes, "engine": engine, "model": model, "device": str(device), "repeats": repeats,
                "load_includes": f"read + {algorithm} of every byte against the manifest + tensors resident on the device",
                "hash_algorithm": algorithm,
                "chunk_size": chunk_size,
                "pagecache_read_gbps": round(read_gbps, 3), "load_gbps": round(load_gbps, 3),
                "load_over_read": round(load_gbps / read_gbps, 3),
                "hash_core_gbps": round(core_gbps, 3), "hash_threads": threads,
                "hash_bound_gbps": round(hash_bound, 3), "load_over_hash_bound": round(load_gbps / hash_bound, 3),
                "h2d_gbps": _h2d_gbps(min(nbytes, 1 << 30))}
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
