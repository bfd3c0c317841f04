import json
import os

import numpy as np
import pytest

from peerd.store import ChunkDigestMismatch, ChunkStore, DiskFullError, StoreError


def chunk_bytes(checkpoint, c):
    with open(checkpoint / c.file, "rb") as f:
        f.seek(c.offset)
        return f.read(c.size)


def test_verified_chunks_persist_across_reopen(tmp_path, signed, checkpoint):
    m, doc = signed
    raw = json.dumps(doc).encode()
    vs = ChunkStore(tmp_path / "s").open_version(m, raw)
    for c in m.chunks[::2]:
        vs.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    vs.close()
    vs2 = ChunkStore(tmp_path / "s").open_version(m, raw)
    assert vs2.bits.tolist() == [i % 2 == 0 for i in range(len(m.chunks))]
    for c in m.chunks[1::2]:
        vs2.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    assert vs2.complete and vs2.verify_files() == []
    # files are assembled in place: the original bytes, ready to memory-map
    for f in m.files:
        assert (vs2.model_dir / f.path).read_bytes() == (checkpoint / f.path).read_bytes()


def test_bad_digest_never_sets_the_bit(tmp_path, signed, checkpoint):
    m, doc = signed
    vs = ChunkStore(tmp_path / "s").open_version(m, json.dumps(doc).encode())
    c = m.chunks[0]
    bad = bytearray(chunk_bytes(checkpoint, c))
    bad[10] ^= 1
    with pytest.raises(ChunkDigestMismatch):
        vs.commit_chunk(0, bytes(bad))
    with pytest.raises(ChunkDigestMismatch):
        vs.commit_chunk(0, chunk_bytes(checkpoint, c)[:-1])
    assert not vs.has(0)
    assert (vs.root / "bitmap").read_bytes()[0] == 0


def test_disk_full_is_a_clear_error(tmp_path, signed):
    m, doc = signed
    with pytest.raises(DiskFullError, match="needs .* free"):
        ChunkStore(tmp_path / "s").open_version(m, json.dumps(doc).encode(), reserve_bytes=1 << 60)


def test_chunks_of_an_earlier_version_are_found_locally(tmp_path, signed, checkpoint, keys):
    from peerd import manifest as mf
    m, doc = signed
    store = ChunkStore(tmp_path / "s")
    vs = store.open_version(m, json.dumps(doc).encode())
    for c in m.chunks:
        vs.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    # v2 changes only the last file
    last = checkpoint / m.files[-1].path
    last.write_bytes(np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes())
    m2 = mf.build_from_directory(checkpoint, "tiny", "v2", chunk_size=m.chunk_size)
    store2 = ChunkStore(tmp_path / "s")   # a restarted daemon finds v1 on disk
    local = store2.local_chunks(exclude_vid=m2.digest)
    found = [local.get((c.digest, c.size)) for c in m2.chunks]
    same = [c for c in m2.chunks if c.file != m.files[-1].path]
    assert all(found[c.index] is not None for c in same)
    assert all(found[c.index] is None for c in m2.chunks if c.file == m.files[-1].path)


def test_worker_threads_write_but_only_the_owner_sets_bits(tmp_path, signed, checkpoint):
    """The double free under load: numpy's mask indexing (count, allocate, fill) raced a bit set by a
    worker thread. Now threads only write and fsync; the in-memory bitmap and counters change on the
    owner's thread alone, and close() waits for writes in flight."""
    from concurrent.futures import ThreadPoolExecutor
    m, doc = signed
    raw = json.dumps(doc).encode()
    vs = ChunkStore(tmp_path / "s").open_version(m, raw)
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(vs.write_chunk, c.index, chunk_bytes(checkpoint, c)) for c in m.chunks]
        while not all(f.done() for f in futures):
            assert not vs.bits.any() and vs.verified_bytes() == 0
        assert all(f.result() is True for f in futures)
    assert vs.done_chunks == 0
    for c in m.chunks:
        vs.mark_verified(c.index)
        vs.mark_verified(c.index)           # idempotent: counted once
    assert vs.complete and vs.verified_bytes() == m.total_size and vs.done_chunks == len(m.chunks)
    vs.close()
    other = ChunkStore(tmp_path / "t").open_version(m, raw)
    other.close()                          # removed while a chunk was arriving: refused, no write to a stale fd
    with pytest.raises(StoreError, match="closed"):
        other.write_chunk(0, chunk_bytes(checkpoint, m.chunks[0]))
    reopened = ChunkStore(tmp_path / "s").open_version(m, raw)   # the durable bitmap has every bit
    assert reopened.complete and reopened.verified_bytes() == m.total_size


def test_a_chunk_written_from_a_view_of_a_larger_reused_buffer(tmp_path, signed, checkpoint):
    """The receive path hands write_chunk a view of a pooled buffer larger than the chunk, still
    holding an earlier chunk's bytes past the end: exactly the view is hashed and written, and a
    corrupted view is refused."""
    m, doc = signed
    vs = ChunkStore(tmp_path / "s").open_version(m, json.dumps(doc).encode())
    c = min((c for c in m.chunks if c.size > 1), key=lambda c: c.size)
    data = chunk_bytes(checkpoint, c)
    buf = bytearray(os.urandom(c.size + 4096))     # stale bytes beyond the chunk
    view = memoryview(buf)[:c.size]
    view[:] = data
    view[c.size // 2] ^= 0xFF
    with pytest.raises(ChunkDigestMismatch):
        vs.write_chunk(c.index, view)
    view[c.size // 2] ^= 0xFF
    assert vs.write_chunk(c.index, view)
    vs.mark_verified(c.index)
    with open(vs.model_dir / c.file, "rb") as f:
        f.seek(c.offset)
        assert f.read(c.size + 1)[:c.size] == data


def test_files_ready_counts_the_leading_files_whose_every_chunk_is_verified(tmp_path, signed, checkpoint):
    m, doc = signed
    vs = ChunkStore(tmp_path / "s").open_version(m, json.dumps(doc).encode())
    first, second, third = (m.chunks_of(f.path) for f in m.files)
    assert len(m.files) == 3 and vs.files_ready() == 0
    for c in second:                       # the second file whole, the first not yet: nothing to read ahead
        vs.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    assert vs.files_ready() == 0
    for c in first[:-1]:
        vs.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    assert vs.files_ready() == 0
    vs.commit_chunk(first[-1].index, chunk_bytes(checkpoint, first[-1]))
    assert vs.files_ready() == 2
    vs.unmark_verified(first[1].index)     # found corrupt on disk: the first file is not whole any more
    assert vs.files_ready() == 0
    vs.commit_chunk(first[1].index, chunk_bytes(checkpoint, first[1]))
    for c in third:
        vs.commit_chunk(c.index, chunk_bytes(checkpoint, c))
    assert vs.files_ready() == 3 and vs.complete
    vs.close()
