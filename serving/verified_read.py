"""Read a version's files from peerd's store and prove every byte against its signed manifest while
reading: each file is read once into memory, its chunks hashed in parallel threads (SHA-256 and
BLAKE3 both release the GIL) as they arrive, and the tensors are then views of those very bytes. A file changed after
peerd verified it is refused, whatever its size, mtime or ``verified.json`` say.

The chain of trust: the rollout checked the manifest's signature and names the version id; the store
keeps each version under ``versions/<version id>/``; the manifest found there must hash to that id.
"""
from __future__ import annotations

import json
import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from peerd import digests
from peerd import manifest as mf

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class VerifyError(RuntimeError):
    """code: unverified (no manifest binds these files) | altered (bytes differ) | bad_checkpoint."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# Files verified ahead of a load (serving/prepare.py), by (version directory, path): the load takes
# them instead of reading again. They are the bytes that were hashed, held in this process's memory.
_ahead: dict[tuple[Path, str], bytearray] = {}
_ahead_lock = threading.Lock()


def offer(model_dir: Path, rel: str, buf) -> None:
    with _ahead_lock:
        _ahead[(Path(model_dir), rel)] = buf


def take(model_dir: Path, rel: str):
    with _ahead_lock:
        return _ahead.pop((Path(model_dir), rel), None)


def drop(model_dir: Path) -> int:
    """Forget what was read ahead for ``model_dir``; the bytes freed."""
    with _ahead_lock:
        gone = [k for k in _ahead if k[0] == Path(model_dir)]
        return sum(len(_ahead.pop(k)) for k in gone)


class VerifiedFiles:
    """The files of the version stored at ``model_dir`` (``<store>/versions/<vid>/model``)."""

    def __init__(self, model_dir: Path, threads: int | None = None, initializer=None):
        """``initializer``: run in each hashing thread first (serving/prepare.py lowers their priority)."""
        self.model_dir = Path(model_dir)
        self.initializer = initializer
        vid = self.model_dir.parent.name
        try:
            doc = json.loads((self.model_dir.parent / "manifest.json").read_bytes())
            self.manifest = mf.parse_body(doc["manifest"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise VerifyError("unverified", f"{model_dir} is not a version in peerd's store (no readable "
                                            f"manifest.json beside it: {e})") from None
        if self.manifest.digest != vid:
            raise VerifyError("unverified", f"the manifest beside {model_dir} hashes to {self.manifest.digest[:12]}…, "
                                            f"not the version id {vid[:12]}… its directory names")
        self.files = {f.path: f for f in self.manifest.files}
        self.threads = threads or self.default_threads()
        self.bytes_hashed = 0
        self.bytes_ahead = 0          # taken from what was verified ahead of the load

    @staticmethod
    def default_threads() -> int:
        return min(8, os.cpu_count() or 2)

    def read(self, rel: str) -> bytearray:
        """The whole file, every chunk checked against the manifest. Raises VerifyError."""
        return next(self.read_each([rel]))[1]

    def read_each(self, rels: list[str]) -> Iterator[tuple[str, bytearray]]:
        """(path, bytes) of each file in turn, each once every chunk of it matched the manifest. One pool
        of hashing threads serves them all: the next file is read, and its chunks hashed, while the last
        chunks of this one finish and while the caller uses it (a pool per file would leave a core idle
        at every file's end). Raises VerifyError."""
        with ThreadPoolExecutor(self.threads, initializer=self.initializer) as pool:
            started = None
            for rel in rels:
                nxt = self._start(pool, rel)
                if started is not None:
                    yield self._finish(*started)
                started = nxt
            if started is not None:
                yield self._finish(*started)

    def _start(self, pool: ThreadPoolExecutor, rel: str) -> tuple[str, bytearray, list]:
        """Read ``rel`` chunk by chunk, each chunk's hash submitted as soon as it is in memory."""
        entry = self.files.get(rel)
        if entry is None:
            raise VerifyError("bad_checkpoint", f"{rel} is not listed in the signed manifest")
        ready = take(self.model_dir, rel)
        if ready is not None and len(ready) == entry.size:
            self.bytes_ahead += len(ready)
            return rel, ready, []
        buf = _buffer(entry.size)
        view = memoryview(buf)
        pending = []
        try:
            with open(self.model_dir / rel, "rb", buffering=0) as fh:
                for c in self.manifest.chunks_of(rel):
                    piece = view[c.offset:c.offset + c.size]
                    got = 0
                    while got < c.size:
                        n = fh.readinto(piece[got:])
                        if not n:
                            raise VerifyError("altered", f"{rel} is shorter than the {entry.size} bytes the manifest says")
                        got += n
                    pending.append((c, pool.submit(digests.hexdigest, self.manifest.hash_algorithm, piece)))
                if fh.read(1):
                    raise VerifyError("altered", f"{rel} is longer than the {entry.size} bytes the manifest says")
        except FileNotFoundError:
            raise VerifyError("altered", f"{rel} disappeared after verification") from None
        return rel, buf, pending

    def _finish(self, rel: str, buf: bytearray, pending: list) -> tuple[str, bytearray]:
        if not pending and self.files[rel].size:
            return rel, buf               # verified ahead of the load
        for c, fut in pending:
            if fut.result() != c.digest:
                raise VerifyError("altered", f"{rel}: chunk {c.index} (bytes {c.offset}..{c.offset + c.size}) "
                                             "does not match the signed manifest; the file changed after "
                                             "verification: remove the version from peerd and fetch it again")
        self.bytes_hashed += len(buf)
        return rel, buf


HUGE = 2 << 20


def _buffer(size: int):
    """Private memory for a file's verified bytes. Large ones are anonymous mappings the kernel backs
    with huge pages when it has them free (transparent huge pages), and with small pages otherwise.
    Neither MADV_HUGEPAGE nor MAP_POPULATE: with the kernel's usual ``defrag=madvise`` the first makes
    every fault wait for memory compaction once free huge pages run out, as they do while a whole
    checkpoint's buffers stay alive, and the second faults a whole file in under the process's
    memory lock, which serialises concurrent loads in one process. Never a mapping of the file
    itself: the tensors must stay the bytes that were verified, whatever later happens to the file."""
    if size < HUGE:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def safetensors_views(buf: bytearray, name: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in ``buf``, as views of it (no copy). Checks the header."""
    try:
        n = int.from_bytes(buf[:8], "little")
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise VerifyError("bad_checkpoint", f"{name}: unreadable safetensors header: {e}") from None
    base, out = 8 + n, {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[meta["dtype"]]
            start, end = (base + int(x) for x in meta["data_offsets"])
            shape = [int(d) for d in meta["shape"]]
        except (KeyError, TypeError, ValueError):
            raise VerifyError("bad_checkpoint", f"{name}: tensor {key!r} has a malformed header entry") from None
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not base <= start <= end <= len(buf) or end - start != count * itemsize:
            raise VerifyError("bad_checkpoint", f"{name}: tensor {key!r} lies outside the file or has the wrong size")
        out[key] = (torch.frombuffer(buf, dtype=dtype, count=count, offset=start).view(shape) if count
                    else torch.empty(shape, dtype=dtype))
    return out
