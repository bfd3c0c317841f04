"""Random-bytes checkpoints for data-plane tests and benchmarks (the serving issue adds real models)."""
from __future__ import annotations

import os
from pathlib import Path


def write_random_checkpoint(root: Path, size: int, files: int = 3, seed: int = 0) -> Path:
    """``files`` files of about ``size / files`` bytes each, deterministic for a seed."""
    import numpy as np
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = size // files
    for i in range(files):
        n = per if i < files - 1 else size - per * (files - 1)
        path = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as f:
            left = n
            while left:
                k = min(left, 8 * 1024 * 1024)
                f.write(rng.integers(0, 256, k, dtype=np.uint8).tobytes())
                left -= k
    return root


def dir_size(root: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(root).rglob("*") if p.is_file())
