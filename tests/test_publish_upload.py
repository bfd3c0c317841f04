"""Publishing's upload against the real S3 server: each file read once, hashed from the buffers sent,
multipart with parts in flight; a staged version's bytes checked against its signed manifest before
they leave."""
import dataclasses
import os
import uuid

import pytest

from peerd import manifest as mf
from peerd.origin import OriginMissing, OriginSpec, S3Origin
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.publish import COMPLETE, MARKER, PublishError, PublishRequest, finish_upload, stage, upload
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from weightcast.upload import MIN_PART, UploadConfig, part_size_for

MiB = 1 << 20


def request(src, seaweed, keys, prefix=None, **kw) -> PublishRequest:
    return PublishRequest(src, "m", "v1", keys["priv_path"],
                          OriginSpec(seaweed.endpoint, seaweed.bucket, prefix or f"up/{uuid.uuid4().hex[:8]}"),
                          chunk_size=MiB, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                          upload=UploadConfig(part_size=MIN_PART, concurrency=3), **kw)


async def stored(req: PublishRequest, rel: str) -> bytes | None:
    async with S3Origin(req.origin, ACCESS_KEY, SECRET_KEY) as o:
        return await o.read_object(rel)


def test_parts_hold_whole_chunks_and_stay_within_s3_limits():
    cfg = UploadConfig(part_size=16 * MiB)
    assert part_size_for(100 * MiB, 64 * MiB, cfg) == 64 * MiB          # at least one whole chunk
    assert part_size_for(100 * MiB, 3 * MiB, cfg) == 18 * MiB           # rounded up to whole chunks
    assert part_size_for(10, MiB, UploadConfig(part_size=1)) == 5 * MiB  # S3's smallest part
    assert part_size_for(400_000 * MiB, MiB, cfg) == 40 * MiB            # at most 10,000 parts


async def test_upload_reads_once_and_its_manifest_is_the_one_a_separate_hash_would_build(tmp_path, seaweed, keys):
    src = write_random_checkpoint(tmp_path / "ckpt", 23 * MiB + 777, files=3, seed=3)   # ~7.7 MiB files: 2 parts
    (src / "empty.bin").write_bytes(b"")
    req = request(src, seaweed, keys)
    pub = await upload(req)
    want = mf.build_from_directory(src, "m", "v1", MiB)
    assert (pub.manifest.files, pub.manifest.chunks) == (want.files, want.chunks)
    assert sorted(pub.uploaded) == sorted(p.name for p in src.iterdir())
    for p in src.iterdir():
        assert await stored(req, p.name) == p.read_bytes()
    assert mf.load_signed(await stored(req, MARKER), [keys["public"]]).digest == pub.manifest.digest
    assert pub.manifest.digest in (await stored(req, COMPLETE)).decode()

    again = await upload(req)                         # a retried job: nothing sent again
    assert again.already_there and again.manifest.digest == pub.manifest.digest and again.uploaded == []


async def test_a_file_changed_after_staging_is_refused_and_never_completed_at_the_origin(tmp_path, seaweed, keys):
    src = write_random_checkpoint(tmp_path / "ckpt", 24 * MiB, files=2, seed=4)
    req = request(src, seaweed, keys)
    staged = await stage(req)
    assert not staged.complete and await stored(req, MARKER) is not None     # signed before any byte
    assert await stored(req, COMPLETE) is None
    victim = sorted(src.iterdir())[1]
    with open(victim, "r+b") as f:                    # one byte in the second part of the file
        f.seek(8 * MiB + 5)
        b = f.read(1)
        f.seek(8 * MiB + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(PublishError, match=r"chunk 20 at offset 8388608 differs from the signed manifest"):
        await finish_upload(req, staged)
    assert await stored(req, victim.name) is None     # its multipart upload was aborted, not completed
    assert await stored(req, COMPLETE) is None        # and the version is not marked published
    async with S3Origin(req.origin, ACCESS_KEY, SECRET_KEY) as o:
        with pytest.raises(OriginMissing):            # what a host reading ahead sees: missing, retried soon
            await o.read_range(victim.name, 0, memoryview(bytearray(16)))


async def test_an_interrupted_upload_is_finished_by_publishing_again_and_other_bytes_are_refused(tmp_path, seaweed, keys):
    src = write_random_checkpoint(tmp_path / "ckpt", 12 * MiB, files=2, seed=5)
    req = request(src, seaweed, keys)
    staged = await stage(req)                         # the publisher died after signing
    again = await stage(req)                          # the retry reuses the signed manifest (same version id)
    assert again.manifest.digest == staged.manifest.digest and not again.complete
    pub = await finish_upload(req, again)
    assert sorted(pub.uploaded) == sorted(p.name for p in src.iterdir())
    assert (await stage(req)).complete

    other = write_random_checkpoint(tmp_path / "other", 12 * MiB, files=2, seed=6)
    for attempt in (stage, upload):
        with pytest.raises(PublishError, match="already published .* with different contents"):
            await attempt(dataclasses.replace(req, source=other))


async def test_a_growing_file_is_refused(tmp_path, seaweed, keys):
    src = write_random_checkpoint(tmp_path / "ckpt", 6 * MiB, files=1, seed=7)
    req = request(src, seaweed, keys)
    staged = await stage(req)
    with open(next(src.iterdir()), "ab") as f:
        f.write(os.urandom(10))
    with pytest.raises(PublishError, match="signed manifest"):
        await finish_upload(req, staged)
