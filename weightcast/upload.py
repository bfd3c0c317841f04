"""Publishing at the storage's speed: each file is read once, in parts; each part's chunks are hashed
from the very buffer that is then uploaded, and the parts of several files are in flight at once
(multipart; a file of one part is a single PUT).

Two uses:
- without a manifest, the digests are collected and the manifest is built from them (sign once the
  last digest is known);
- with the signed manifest (the publisher hashed first and started the rollout), every chunk is checked
  against it before its part leaves: a file changed since it was hashed is refused, its multipart
  upload is aborted, and the origin never holds a byte the signed manifest does not cover.

An object appears at the origin only when its upload completes, so a host reading while the publish
runs finds a file whole or not at all (and retries shortly: peerd/origin.OriginMissing).
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peerd import manifest as mf
from peerd.origin import S3Origin

log = logging.getLogger("weightcast.upload")

MiB = 1 << 20
MIN_PART = 5 * MiB          # S3's smallest part (but the last)
MAX_PARTS = 10_000          # S3's most parts per object


@dataclass(frozen=True)
class UploadConfig:
    part_size: int = 16 * MiB   # rounded up to whole chunks, so every chunk is checked before its part leaves
    concurrency: int = 8        # parts read, hashed or uploading at once, across all files (memory: this × part)


class Changed(RuntimeError):
    """A file's bytes differ from the manifest they are published under."""


def part_size_for(file_size: int, chunk_size: int, cfg: UploadConfig) -> int:
    """Whole chunks per part, at least S3's minimum, few enough parts for S3's limit."""
    want = max(cfg.part_size, MIN_PART, -(-file_size // MAX_PARTS))
    return -(-want // chunk_size) * chunk_size


@dataclass
class FileUpload:
    path: Path
    rel: str
    first_chunk: int
    expect: tuple[mf.FileEntry, list[mf.Chunk]] | None = None


class Uploader:
    """Uploads ``files`` (manifest order) through ``origin``; ``progress(n)`` is called per part sent."""

    def __init__(self, origin: S3Origin, chunk_size: int, algorithm: str, cfg: UploadConfig = UploadConfig(),
                 progress: Callable[[int], None] | None = None):
        self.origin, self.chunk_size, self.algorithm, self.cfg = origin, chunk_size, algorithm, cfg
        self.progress = progress or (lambda n: None)
        self._slots = asyncio.Semaphore(cfg.concurrency)

    async def run(self, files: list[FileUpload]) -> list[tuple[mf.FileEntry, list[mf.Chunk]]]:
        """Every file uploaded; each file's (entry, chunks) as hashed from the bytes sent. Raises Changed
        (nothing of that file is left at the origin) or the origin's error."""
        # files start in order and take part slots first come, first served: the front of the
        # checkpoint (what hosts read first) is complete first
        tasks = [asyncio.ensure_future(self._file(f)) for f in files]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _file(self, f: FileUpload) -> tuple[mf.FileEntry, list[mf.Chunk]]:
        size = f.path.stat().st_size
        part = part_size_for(size, self.chunk_size, self.cfg)
        # checked against a manifest, the chunks cover every byte: the whole-file digest would be a second hash
        hasher = mf.ChunkHasher(f.rel, self.chunk_size, f.first_chunk, self.algorithm, file_digest=f.expect is None)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            if size <= part:
                async with self._slots:
                    data = await asyncio.to_thread(self._read_hash, fd, 0, size, hasher, f)
                    result = self._finish(hasher, f, size)
                    await self.origin.put_bytes(self.origin.spec.key(f.rel), data)
                self.progress(size)
                return result
            return await self._multipart(fd, size, part, hasher, f)
        finally:
            os.close(fd)

    async def _multipart(self, fd: int, size: int, part: int, hasher: mf.ChunkHasher, f: FileUpload):
        upload_id = await self.origin.start_multipart(f.rel)
        sent: list[asyncio.Task] = []
        try:
            for n, offset in enumerate(range(0, size, part), start=1):
                await self._slots.acquire()
                try:
                    # read and hash in order (the file digest is one sequential hash); the uploads overlap
                    data = await asyncio.to_thread(self._read_hash, fd, offset, min(part, size - offset), hasher, f)
                except BaseException:
                    self._slots.release()
                    raise
                sent.append(asyncio.ensure_future(self._send(f.rel, upload_id, n, data)))
            result = self._finish(hasher, f, size)
            parts = await asyncio.gather(*sent)
            await self.origin.complete_multipart(f.rel, upload_id, list(parts))
            return result
        except BaseException:
            for t in sent:
                t.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
            await asyncio.shield(self._abort(f.rel, upload_id))
            raise

    async def _send(self, rel: str, upload_id: str, n: int, data: bytes) -> dict:
        try:
            out = await self.origin.put_part(rel, upload_id, n, data)
        finally:
            self._slots.release()
        self.progress(len(data))
        return out

    async def _abort(self, rel: str, upload_id: str) -> None:
        try:
            await self.origin.abort_multipart(rel, upload_id)
        except Exception as e:  # noqa: BLE001 - the upload's own error is the one raised; this one is logged
            log.warning("could not abort the multipart upload of %s (%s); the storage's lifecycle rule expires "
                        "it", rel, e)

    def _read_hash(self, fd: int, offset: int, length: int, hasher: mf.ChunkHasher, f: FileUpload) -> bytes:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise Changed(f"{f.path} is shorter than when the upload began; publish a finished checkpoint")
        had = len(hasher.chunks)
        hasher.update(data)
        if f.expect is not None:
            _check_chunks(f, hasher.chunks[had:])
        return data

    @staticmethod
    def _finish(hasher: mf.ChunkHasher, f: FileUpload, size: int) -> tuple[mf.FileEntry, list[mf.Chunk]]:
        had = len(hasher.chunks)
        fe, chunks = hasher.finish()
        if f.expect is not None:
            _check_chunks(f, chunks[had:])
            if fe.size != f.expect[0].size:
                raise Changed(f"{f.rel}: {fe.size} bytes, the signed manifest says {f.expect[0].size}: it changed "
                              "since it was hashed")
            return f.expect[0], chunks
        return fe, chunks


def _check_chunks(f: FileUpload, got: list[mf.Chunk]) -> None:
    want = f.expect[1]
    for c in got:
        k = c.index - f.first_chunk
        if k >= len(want) or want[k] != c:
            raise Changed(f"{f.rel}: chunk {c.index} at offset {c.offset} differs from the signed manifest: "
                          "the file changed since it was hashed; nothing of it was left at the origin")


def plan(root: Path, chunk_size: int, expect: mf.Manifest | None = None) -> list[FileUpload]:
    """The files of ``root`` in manifest order; with ``expect``, each paired with what it must hash to
    (a file the manifest does not list, or a missing one, is refused)."""
    paths = mf.list_files(root)
    rels = [mf.safe_relative_path(p.relative_to(root).as_posix()) for p in paths]
    if expect is None:
        firsts = mf.first_chunk_indexes([p.stat().st_size for p in paths], chunk_size)
        return [FileUpload(p, r, k) for p, r, k in zip(paths, rels, firsts)]
    listed = [fe.path for fe in expect.files]
    if rels != listed:
        raise Changed(f"the checkpoint's files are not the ones the manifest lists (extra: "
                      f"{sorted(set(rels) - set(listed))[:5]}, missing: {sorted(set(listed) - set(rels))[:5]})")
    return [FileUpload(p, fe.path, cs[0].index if cs else 0, (fe, cs))
            for p, fe, cs in ((p, fe, expect.chunks_of(fe.path)) for p, fe in zip(paths, expect.files))]
