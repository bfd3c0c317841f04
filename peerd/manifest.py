"""The signed manifest: what a version is, chunk by chunk.

The signed document is ``{"manifest": {...}, "signature": {"key_id", "sig"}}``. The signature covers
the canonical JSON of ``manifest`` (sorted keys, no whitespace, UTF-8), and the SHA-256 of those same
bytes is the version id: the rollout's identity everywhere (store paths, HTTP, workflow inputs).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from peerd import digests, signing

SCHEMA = "weightcast.manifest/v1"
HASH_ALGORITHM = "sha256"       # the default for chunk and file digests; "blake3" is the cheaper choice
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_NAME_BYTES = 255            # one path component (NAME_MAX on Linux file systems)
MAX_SERVING_BYTES = 1024 * 1024 # the optional 'serving' record (golden prompts): small by design
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}\Z")


class ManifestError(ValueError):
    """The manifest is malformed, inconsistent, unsafe or not signed by a trusted key."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    digest: str


@dataclass(frozen=True, slots=True)          # slots: a 1 TB manifest has ~400,000 of these
class Chunk:
    index: int
    file: str
    offset: int
    size: int
    digest: str


@dataclass(frozen=True)
class Manifest:
    model: str
    version: str
    created_at: str
    chunk_size: int
    files: tuple[FileEntry, ...]
    chunks: tuple[Chunk, ...]
    hash_algorithm: str = HASH_ALGORITHM
    schema: str = SCHEMA
    # what serving needs to check the loaded model (golden prompts, serving/golden.py); signed with the
    # rest, absent from the body when empty (so manifests without it keep their version ids)
    serving: dict | None = None
    _by_file: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def body(self) -> dict:
        return {
            "schema": self.schema, "model": self.model, "version": self.version,
            "created_at": self.created_at, "hash_algorithm": self.hash_algorithm,
            "chunk_size": self.chunk_size,
            "files": [{"path": f.path, "size": f.size, "digest": f.digest} for f in self.files],
            "chunks": [{"index": c.index, "file": c.file, "offset": c.offset, "size": c.size,
                        "digest": c.digest} for c in self.chunks],
            **({"serving": self.serving} if self.serving else {}),
        }

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.body())

    @cached_property
    def digest(self) -> str:
        """The version id: SHA-256 of the canonical manifest body."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def chunks_of(self, path: str) -> list[Chunk]:
        if not self._by_file:
            for c in self.chunks:
                self._by_file.setdefault(c.file, []).append(c)
        return self._by_file.get(path, [])


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------- building

class ChunkHasher:
    """Consumes one file's bytes in any pieces; cuts them into chunks of ``chunk_size``.

    Lets the directory and the S3 builder share one code path, streaming: nothing is held but the
    current chunk's hash state.
    """

    def __init__(self, path: str, chunk_size: int, first_index: int, algorithm: str = HASH_ALGORITHM,
                 file_digest: bool = True):
        """``file_digest=False``: chunks only (the file entry's digest is left empty), for a reader
        that checks bytes against a manifest whose chunks already cover every byte of the file."""
        self.path, self.chunk_size, self.next_index, self.algorithm = path, chunk_size, first_index, algorithm
        self.file_hash = digests.new(algorithm) if file_digest else None
        self.chunk_hash = digests.new(algorithm)
        self.chunk_fill = 0
        self.offset = 0
        self.chunks: list[Chunk] = []

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data)
        if self.file_hash is not None:
            self.file_hash.update(mv)
        while len(mv):
            take = min(len(mv), self.chunk_size - self.chunk_fill)
            self.chunk_hash.update(mv[:take])
            self.chunk_fill += take
            mv = mv[take:]
            if self.chunk_fill == self.chunk_size:
                self._cut()

    def _cut(self) -> None:
        self.chunks.append(Chunk(self.next_index, self.path, self.offset, self.chunk_fill,
                                 self.chunk_hash.hexdigest()))
        self.next_index += 1
        self.offset += self.chunk_fill
        self.chunk_fill = 0
        self.chunk_hash = digests.new(self.algorithm)

    def finish(self) -> tuple[FileEntry, list[Chunk]]:
        if self.chunk_fill:
            self._cut()
        return FileEntry(self.path, self.offset, self.file_hash.hexdigest() if self.file_hash else ""), self.chunks


def build_from_directory(root: Path, model: str, version: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         algorithm: str = HASH_ALGORITHM, serving: dict | None = None,
                         threads: int | None = None) -> Manifest:
    """Hash every file under ``root``, files in parallel threads (both digests release the GIL): a
    checkpoint of many shards hashes at the page cache's speed times the cores."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"{root} is not a directory")
    if algorithm not in digests.ALGORITHMS:
        raise ManifestError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(digests.ALGORITHMS)}")
    paths = list_files(root)
    if not paths:
        raise ManifestError(f"{root} holds no files to publish")
    rels = [safe_relative_path(p.relative_to(root).as_posix()) for p in paths]
    firsts = first_chunk_indexes([p.stat().st_size for p in paths], chunk_size)

    def one(k: int) -> tuple[FileEntry, list[Chunk]]:
        h = ChunkHasher(rels[k], chunk_size, firsts[k], algorithm)
        for piece in iter_file_pieces(paths[k]):
            h.update(piece)
        return h.finish()

    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 2)) as pool:
        done = list(pool.map(one, range(len(paths))))
    files = [fe for fe, _ in done]
    for k, (fe, _) in enumerate(done):
        if fe.size != paths[k].stat().st_size:
            raise ManifestError(f"{paths[k]} changed size while it was hashed; publish a finished checkpoint")
    return assemble(model, version, chunk_size, files, [c for _, cs in done for c in cs], algorithm=algorithm,
                    serving=serving)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".gguf")


def list_files(root: Path) -> list[Path]:
    """The files a checkpoint directory publishes, in manifest order (hidden files stay behind): the
    weights last, so that the small files an engine starts from (config, tokenizer) are the first a
    host has whole (the swarm fetches in manifest order, rarest first within a window), and a
    serving engine can start while the weights still arrive (serving/vllm_engine.py)."""
    files = (p for p in Path(root).rglob("*") if p.is_file() and not p.name.startswith("."))
    return sorted(files, key=lambda p: (p.name.endswith(WEIGHT_SUFFIXES), p))


def first_chunk_indexes(sizes: list[int], chunk_size: int) -> list[int]:
    """The index of each file's first chunk, files in order (an empty file has no chunk)."""
    out, n = [], 0
    for size in sizes:
        out.append(n)
        n += -(-size // chunk_size)
    return out


def assemble(model: str, version: str, chunk_size: int, files: list[FileEntry], chunks: list[Chunk],
             created_at: str | None = None, algorithm: str = HASH_ALGORITHM, serving: dict | None = None) -> Manifest:
    m = Manifest(model=model, version=version,
                 created_at=created_at or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 chunk_size=chunk_size, files=tuple(files), chunks=tuple(chunks), hash_algorithm=algorithm,
                 serving=serving or None)
    validate(m)
    return m


# ---------------------------------------------------------------- signing

def sign_manifest(m: Manifest, key: Ed25519PrivateKey) -> dict:
    return {"manifest": m.body(),
            "signature": {"key_id": signing.public_key_id(key.public_key()),
                          "sig": signing.sign(key, m.canonical_bytes())}}


def signed_bytes(m: Manifest, key: Ed25519PrivateKey) -> bytes:
    return json.dumps(sign_manifest(m, key), indent=1).encode()


def load_signed(data: bytes, trusted: list[Ed25519PublicKey]) -> Manifest:
    """Parse, validate and check the signature. Raises ManifestError saying what is wrong."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from None
    return verify_signed(doc, trusted)


def verify_signed(doc, trusted: list[Ed25519PublicKey]) -> Manifest:
    """``load_signed`` for a document already parsed from JSON (a job body, say)."""
    if not isinstance(doc, dict) or set(doc) != {"manifest", "signature"}:
        raise ManifestError("a signed manifest has exactly two keys, 'manifest' and 'signature'; "
                            "sign it with `weightcast manifest build --key ...`")
    m, canonical = _parse(doc["manifest"])
    sig = doc["signature"]
    if not isinstance(sig, dict) or not isinstance(sig.get("key_id"), str) or not isinstance(sig.get("sig"), str):
        raise ManifestError("signature must be an object with string 'key_id' and 'sig'")
    if not trusted:
        raise ManifestError("no trusted public keys configured; refusing to accept any manifest")
    if not signing.verify(trusted, canonical, sig["sig"], sig["key_id"]):
        known = ", ".join(signing.public_key_id(k) for k in trusted)
        raise ManifestError(f"bad signature: manifest signed by key {sig['key_id']!r} does not verify "
                            f"against the trusted keys ({known})")
    return m


def parse_body(body) -> Manifest:
    """A validated manifest body (no signature check); its version id is the hash of the body as given."""
    return _parse(body)[0]


def _parse(body) -> tuple[Manifest, bytes]:
    """The manifest and the canonical bytes of the body as received. The version id is their hash, not
    a re-serialisation of the parsed objects: no second copy of a 400,000-chunk body is built, and an
    entry with extra fields changes the id (and fails the signature) instead of being ignored."""
    if not isinstance(body, dict):
        raise ManifestError("'manifest' must be an object")
    expected = {"schema", "model", "version", "created_at", "hash_algorithm", "chunk_size", "files", "chunks"}
    if not expected <= set(body) <= expected | {"serving"}:
        raise ManifestError(f"manifest fields must be {sorted(expected)} (and optionally 'serving'); "
                            f"got {sorted(body)}")
    try:
        files = tuple(FileEntry(path=f["path"], size=f["size"], digest=f["digest"]) for f in body["files"])
        chunks = tuple(Chunk(index=c["index"], file=c["file"], offset=c["offset"], size=c["size"],
                             digest=c["digest"]) for c in body["chunks"])
    except (TypeError, KeyError) as e:
        raise ManifestError(f"malformed file or chunk entry: missing or wrong field {e}") from None
    m = Manifest(model=body["model"], version=body["version"], created_at=body["created_at"],
                 chunk_size=body["chunk_size"], files=files, chunks=chunks,
                 hash_algorithm=body["hash_algorithm"], schema=body["schema"], serving=body.get("serving"))
    validate(m)
    canonical = canonical_json(body)
    m.__dict__["digest"] = hashlib.sha256(canonical).hexdigest()   # fills the cached_property
    return m, canonical


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What the store writes beside a version's files (peerd/store.py): the record of what was verified,
# and write_atomic's temporary names for it. A signed file under either name would overwrite it.
VERIFIED_NAME = "verified.json"
RESERVED = (VERIFIED_NAME, f".{VERIFIED_NAME}.")     # the name itself; the prefix of its temporary names


def safe_relative_path(p) -> str:
    """Refuse anything that could land outside the model directory, or on a name the store keeps
    there for itself."""
    if not isinstance(p, str) or not p or len(p) > 1024 or "\\" in p or "\x00" in p:
        raise ManifestError(f"file path {p!r} is not a plain relative POSIX path")
    pp = PurePosixPath(p)
    if pp.is_absolute() or any(part in ("..", ".", "") for part in p.split("/")):
        raise ManifestError(f"file path {p!r} escapes the model directory")
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in p.split("/")):
        raise ManifestError(f"file path {p!r} has a component over {MAX_NAME_BYTES} bytes (no file system takes it)")
    if any(not ch.isprintable() for ch in p):
        raise ManifestError(f"file path {p!r} holds control or unprintable characters")
    if p == RESERVED[0] or p.startswith(RESERVED[1]):
        raise ManifestError(f"file path {p!r} is reserved: the store keeps its record of the verified files "
                            f"({VERIFIED_NAME}) beside them")
    return p


def validate(m: Manifest) -> None:
    if m.schema != SCHEMA:
        raise ManifestError(f"unknown manifest schema {m.schema!r}; this peerd reads {SCHEMA!r}")
    if m.hash_algorithm not in digests.ALGORITHMS:
        raise ManifestError(f"unsupported hash algorithm {m.hash_algorithm!r}; this peerd reads "
                            f"{', '.join(repr(a) for a in digests.ALGORITHMS)}")
    for name, v in (("model", m.model), ("version", m.version)):
        if not isinstance(v, str) or not _NAME.match(v):
            raise ManifestError(f"{name} {v!r} must match {_NAME.pattern}")
    if not isinstance(m.created_at, str):
        raise ManifestError("created_at must be a string")
    if m.serving is not None and (not isinstance(m.serving, dict) or not m.serving
                                  or len(canonical_json(m.serving)) > MAX_SERVING_BYTES):
        raise ManifestError(f"serving must be a non-empty object of at most {MAX_SERVING_BYTES} bytes")
    if not _is_int(m.chunk_size) or not (1 <= m.chunk_size <= 4 * 1024**3):
        raise ManifestError(f"chunk_size {m.chunk_size!r} must be an integer in [1, 4 GiB]")
    if not m.files:
        raise ManifestError("manifest lists no files")
    seen = set()
    for f in m.files:
        safe_relative_path(f.path)
        if f.path in seen:
            raise ManifestError(f"file {f.path!r} listed twice")
        seen.add(f.path)
        if not _is_int(f.size) or f.size < 0:
            raise ManifestError(f"file {f.path!r} has invalid size {f.size!r}")
        if not isinstance(f.digest, str) or not _HEX64.match(f.digest):
            raise ManifestError(f"file {f.path!r} digest must be 64 lowercase hex characters")
    prefixes = {str(a) for p in seen for a in PurePosixPath(p).parents}
    clash = seen & prefixes
    if clash:
        raise ManifestError(f"path {sorted(clash)[0]!r} is both a file and a directory")
    next_offset = {f.path: 0 for f in m.files}
    for i, c in enumerate(m.chunks):
        if not _is_int(c.index) or c.index != i:
            raise ManifestError(f"chunk at position {i} has index {c.index!r}; indices must be 0..n-1 in order")
        if not isinstance(c.file, str) or c.file not in next_offset:
            raise ManifestError(f"chunk {i} refers to unknown file {c.file!r}")
        if not _is_int(c.offset) or not _is_int(c.size):
            raise ManifestError(f"chunk {i} offset and size must be integers")
        if c.offset != next_offset[c.file]:
            raise ManifestError(f"chunk {i} of {c.file!r} starts at {c.offset}, expected {next_offset[c.file]} "
                                "(chunks must tile each file without gaps or overlaps)")
        if not (1 <= c.size <= m.chunk_size):
            raise ManifestError(f"chunk {i} size {c.size} is outside [1, chunk_size={m.chunk_size}]")
        if not isinstance(c.digest, str) or not _HEX64.match(c.digest):
            raise ManifestError(f"chunk {i} digest must be 64 lowercase hex characters")
        next_offset[c.file] += c.size
    for f in m.files:
        if next_offset[f.path] != f.size:
            raise ManifestError(f"file {f.path!r} declares {f.size} bytes but its chunks cover "
                                f"{next_offset[f.path]}")


def iter_file_pieces(path: Path, block: int = 4 * 1024 * 1024) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while b := f.read(block):
            yield b


def summarize(m: Manifest) -> dict:
    return {"model": m.model, "version": m.version, "version_id": m.digest, "files": len(m.files),
            "chunks": len(m.chunks), "bytes": m.total_size, "chunk_size": m.chunk_size,
            "created_at": m.created_at}


def build_from_pieces(model: str, version: str, chunk_size: int, files: Iterable[tuple[str, Iterable[bytes]]],
                      algorithm: str = HASH_ALGORITHM, serving: dict | None = None) -> Manifest:
    """Build from (path, byte pieces) pairs in path order; used by the S3 builder."""
    if algorithm not in digests.ALGORITHMS:
        raise ManifestError(f"unknown hash algorithm {algorithm!r}; use one of {', '.join(digests.ALGORITHMS)}")
    out_files, out_chunks = [], []
    for path, pieces in files:
        h = ChunkHasher(safe_relative_path(path), chunk_size, len(out_chunks), algorithm)
        for p in pieces:
            h.update(p)
        fe, cs = h.finish()
        out_files.append(fe)
        out_chunks.extend(cs)
    return assemble(model, version, chunk_size, out_files, out_chunks, algorithm=algorithm, serving=serving)
