"""A durable checkpoint's files on disk, without torch (host workers read and move them without
importing it): the step directories, each rank's digests, the completion mark and its check. The
layout and the completion protocol are described in training/checkpoint.py."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lib.atomic import write_atomic
from peerd.manifest import ChunkHasher, iter_file_pieces

MARK = "complete.json"
MERGED = "merged.json"                  # node-local: every rank's digests, before this host has every file
CHUNK_SIZE = 64 * 1024 * 1024           # the chunks a checkpoint moves in through peerd's swarm


@dataclass(frozen=True)
class Complete:
    step: int
    path: Path


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digests(f: Path, chunk_size: int | None) -> list:
    """[size, SHA-256], and with ``chunk_size`` the chunk SHA-256s a swarm manifest needs (node-local
    checkpoints: one read, each byte hashed twice); on a shared volume nothing needs them."""
    if chunk_size is None:
        return [f.stat().st_size, _sha256(f)]
    hasher = ChunkHasher(f.name, chunk_size, 0)
    for piece in iter_file_pieces(f, 1 << 20):
        hasher.update(piece)
    entry, chunks = hasher.finish()
    return [entry.size, entry.digest, [c.digest for c in chunks]]


def mark_bytes(step: int, parts: list[dict]) -> bytes:
    """The completion mark from every rank's digests; byte-identical wherever it is merged."""
    files: dict = {}
    for p in parts:
        files.update(p["files"])
    return json.dumps({"step": step, "world_size": parts[0]["world_size"], "chunk_size": parts[0].get("chunk_size"),
                       "files": files}, sort_keys=True).encode()


def _own_files(path: Path, rank: int) -> list[Path]:
    """The files this rank's save wrote (DCP's file system writer names them __<rank>_<n>.distcp)."""
    return sorted(path.glob(f"__{rank}_*.distcp")) + ([path / ".metadata"] if rank == 0 else [])


def write_digests(path: Path, rank: int, world_size: int, chunk_size: int | None = None) -> bytes:
    """This rank's share of the completion mark: the size and SHA-256 of each file it wrote (and with
    ``chunk_size`` its chunk digests)."""
    files = {f.name: _digests(f, chunk_size) for f in _own_files(path, rank)}
    raw = json.dumps({"rank": rank, "world_size": world_size, "chunk_size": chunk_size, "files": files}).encode()
    write_atomic(path / f"digests-{rank}.json", raw)
    return raw


def try_mark(path: Path, step: int) -> bool:
    """Merge every rank's digests into the completion mark once all are there; True when marked."""
    if (path / MARK).exists():
        return True
    try:
        parts = [json.loads(f.read_text()) for f in sorted(path.glob("digests-*.json"))]
    except (OSError, ValueError):
        return False                        # one still being replaced: next time
    if not parts or len(parts) != parts[0]["world_size"]:
        return False
    write_atomic(path / MARK, mark_bytes(step, parts))
    return True


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def check(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why this checkpoint cannot be used, or None if it is complete and intact. ``share`` (i, n): hash
    only every n-th file from the i-th (the ranks split the work); sizes and presence are checked for all."""
    if not (path / MARK).exists():
        try_mark(path, step_of(path))      # every rank's digests written, the mark not yet merged
    try:
        mark = json.loads((path / MARK).read_text())
    except FileNotFoundError:
        return "not marked complete (a save that did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable completion mark: {e}"
    files = mark.get("files", {})
    if ".metadata" not in files:
        return "no DCP metadata recorded"
    bad = []
    for i, (name, (size, digest, *_)) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            bad.append(name)
        elif i % share[1] == share[0] and _sha256(f) != digest:
            bad.append(name)
    return f"files changed or missing since the save: {', '.join(bad)}" if bad else None
