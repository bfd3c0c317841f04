"""The origin: object storage over the S3 API (AWS S3, SeaweedFS, MinIO, Ceph RGW, R2, GCS interop)."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import ClientError

from peerd.manifest import HASH_ALGORITHM, ChunkHasher, Manifest, assemble, safe_relative_path


class OriginError(RuntimeError):
    pass


class OriginMissing(OriginError):
    """The object is not there (yet): a publish still uploading it, or a wrong prefix."""


@dataclass(frozen=True)
class OriginSpec:
    endpoint: str
    bucket: str
    prefix: str = ""
    region: str = "us-east-1"

    @classmethod
    def parse_url(cls, url: str, endpoint: str) -> "OriginSpec":
        if not url.startswith("s3://"):
            raise OriginError(f"{url!r} is not an s3://bucket/prefix URL")
        bucket, _, prefix = url[5:].partition("/")
        return cls(endpoint=endpoint, bucket=bucket, prefix=prefix.strip("/"))

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path


async def warm_session():
    """A botocore session with the S3 model already loaded (that costs about a CPU-second), so the
    first origin read of a rollout does not wait for it."""
    session = get_session()
    async with session.create_client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
                                     aws_access_key_id="x", aws_secret_access_key="x"):
        pass
    return session


CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0       # nothing received this long: the request fails (a PUT's answer included)


class S3Origin:
    """One client per daemon; credentials from the usual AWS variables (or explicit)."""

    def __init__(self, spec: OriginSpec, access_key: str | None = None, secret_key: str | None = None,
                 session=None, read_timeout_s: float = READ_TIMEOUT_S):
        self.spec = spec
        self.read_timeout_s = read_timeout_s
        self._session = session or get_session()
        self._ak = access_key or os.environ.get("AWS_ACCESS_KEY_ID")
        self._sk = secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
        self._stack = contextlib.AsyncExitStack()
        self._client = None

    async def __aenter__(self):
        self._client = await self._stack.enter_async_context(self._session.create_client(
            "s3", endpoint_url=self.spec.endpoint, region_name=self.spec.region,
            aws_access_key_id=self._ak, aws_secret_access_key=self._sk,
            # no per-request CRC32 on either side: every chunk is checked against the signed manifest,
            # and the checksums cost CPU on every byte the publisher sends and every host reads
            # a read that receives nothing for read_timeout_s fails, and the chunk is asked for again: with
            # botocore's 60 s (retried twice) one stuck GET would hold a seeder's origin slot for minutes
            config=Config(retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=32,
                          connect_timeout=CONNECT_TIMEOUT_S, read_timeout=self.read_timeout_s,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required")))
        return self

    async def __aexit__(self, *exc):
        await self._stack.aclose()

    async def read_range(self, path: str, offset: int, into: memoryview, on_piece=None) -> None:
        """Fill ``into`` with the ``len(into)`` bytes at ``offset``; ``on_piece(n)`` is awaited per piece
        (rate limiting). Each piece is copied once, to its place in ``into``."""
        size = len(into)
        try:
            resp = await self._client.get_object(Bucket=self.spec.bucket, Key=self.spec.key(path),
                                                 Range=f"bytes={offset}-{offset + size - 1}")
        except self._client.exceptions.NoSuchKey:
            raise OriginMissing(f"origin has no {path} (yet)") from None
        except Exception as e:  # botocore raises many types; all mean "origin read failed"
            raise OriginError(f"origin read of {path}@{offset}+{size} failed: {e}") from e
        pos = 0
        async with resp["Body"] as body:
            while pos < size:
                piece = await body.read(min(256 * 1024, size - pos))
                if not piece:
                    break
                if on_piece:
                    await on_piece(len(piece))
                into[pos:pos + len(piece)] = piece
                pos += len(piece)
        if pos != size:
            raise OriginError(f"origin returned {pos} bytes for {path}@{offset}, expected {size}")

    async def put_file(self, path: str, local_path) -> None:
        with open(local_path, "rb") as f:
            await self._client.put_object(Bucket=self.spec.bucket, Key=self.spec.key(path), Body=f)

    async def upload_directory(self, root) -> list[str]:
        """Every file under ``root``, one PUT each in turn (test and benchmark set-up; publishing goes
        through weightcast/upload.py)."""
        from pathlib import Path
        root = Path(root)
        paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
        for p in paths:
            await self.put_file(p.relative_to(root).as_posix(), p)
        return [p.relative_to(root).as_posix() for p in paths]

    # multipart: an object appears only when its upload completes, so a reader never sees part of one
    async def start_multipart(self, path: str) -> str:
        r = await self._client.create_multipart_upload(Bucket=self.spec.bucket, Key=self.spec.key(path))
        return r["UploadId"]

    async def put_part(self, path: str, upload_id: str, number: int, data) -> dict:
        r = await self._client.upload_part(Bucket=self.spec.bucket, Key=self.spec.key(path), UploadId=upload_id,
                                           PartNumber=number, Body=bytes(data) if isinstance(data, memoryview) else data)
        return {"PartNumber": number, "ETag": r["ETag"]}

    async def complete_multipart(self, path: str, upload_id: str, parts: list[dict]) -> None:
        await self._client.complete_multipart_upload(Bucket=self.spec.bucket, Key=self.spec.key(path),
                                                     UploadId=upload_id, MultipartUpload={"Parts": parts})

    async def abort_multipart(self, path: str, upload_id: str) -> None:
        await self._client.abort_multipart_upload(Bucket=self.spec.bucket, Key=self.spec.key(path), UploadId=upload_id)

    async def download_file(self, path: str, local_path) -> int:
        """Stream one object to a local file (any size); the bytes written."""
        try:
            resp = await self._client.get_object(Bucket=self.spec.bucket, Key=self.spec.key(path))
        except Exception as e:  # botocore raises many types; all mean "origin read failed"
            raise OriginError(f"origin read of {path} failed: {e}") from e
        n = 0
        with open(local_path, "wb") as f:
            async with resp["Body"] as body:
                while piece := await body.read(1 << 20):
                    f.write(piece)
                    n += len(piece)
        return n

    async def read_object(self, path: str) -> bytes | None:
        """A whole (small) object under the prefix, or None when it does not exist."""
        try:
            resp = await self._client.get_object(Bucket=self.spec.bucket, Key=self.spec.key(path))
        except self._client.exceptions.NoSuchKey:
            return None
        except Exception as e:  # botocore raises many types; all mean "origin read failed"
            raise OriginError(f"origin read of {path} failed: {e}") from e
        async with resp["Body"] as body:
            return await body.read()

    async def put_bytes(self, key: str, data: bytes) -> None:
        await self._client.put_object(Bucket=self.spec.bucket, Key=key, Body=data)

    async def ensure_bucket(self) -> None:
        """Create the bucket unless it exists. Another creator may win the race between our
        HEAD and CREATE (weed mini's own -bucket does, at start-up): that is success too."""
        try:
            await self._client.head_bucket(Bucket=self.spec.bucket)
            return
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise OriginError(f"cannot check bucket {self.spec.bucket!r}: {e}") from e
        except Exception as e:  # connection and endpoint errors: the origin is unreachable
            raise OriginError(f"cannot reach the origin at {self.spec.endpoint}: {e}") from e
        try:
            await self._client.create_bucket(Bucket=self.spec.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise OriginError(f"cannot create bucket {self.spec.bucket!r}: {e}") from e
        except Exception as e:
            raise OriginError(f"cannot reach the origin at {self.spec.endpoint}: {e}") from e

    async def list_files(self) -> list[tuple[str, int]]:
        out = []
        prefix = self.spec.key("") if self.spec.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.spec.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                rel = o["Key"][len(prefix):]
                if rel and not rel.rsplit("/", 1)[-1].startswith("."):
                    out.append((rel, o["Size"]))
        return sorted(out)

    async def build_manifest(self, model: str, version: str, chunk_size: int, algorithm: str = HASH_ALGORITHM) -> Manifest:
        """Stream every object once through the chunk hasher; nothing lands on local disk."""
        files, chunks = [], []
        listing = await self.list_files()
        if not listing:
            raise OriginError(f"s3://{self.spec.bucket}/{self.spec.prefix} holds no files")
        for rel, size in listing:
            h = ChunkHasher(safe_relative_path(rel), chunk_size, len(chunks), algorithm)
            resp = await self._client.get_object(Bucket=self.spec.bucket, Key=self.spec.key(rel))
            async with resp["Body"] as body:
                while piece := await body.read(4 * 1024 * 1024):
                    h.update(piece)
            fe, cs = h.finish()
            if fe.size != size:
                raise OriginError(f"{rel}: listed {size} bytes but read {fe.size}; was it overwritten?")
            files.append(fe)
            chunks.extend(cs)
        return assemble(model, version, chunk_size, files, chunks, algorithm=algorithm)

