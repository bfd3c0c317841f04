"""The storage's own speed: a bare aiobotocore multipart upload of a checkpoint's files, with the part
size and parts in flight that publishing uses, and nothing else (no hashing, no manifest). `bench
rollout` runs it against the same endpoint in the same run, as the bound for ``publish_s``."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from aiobotocore.session import get_session
from botocore.config import Config

from peerd import manifest as mf
from weightcast.upload import UploadConfig, part_size_for


async def bare_multipart(endpoint: str, bucket: str, prefix: str, root: Path, access_key: str, secret_key: str,
                         chunk_size: int, cfg: UploadConfig = UploadConfig()) -> float:
    """Seconds to upload every file under ``root`` to ``s3://bucket/prefix``."""
    slots = asyncio.Semaphore(cfg.concurrency)
    async with get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access_key,
            aws_secret_access_key=secret_key, config=Config(max_pool_connections=32, request_checksum_calculation="when_required",
                                                     response_checksum_validation="when_required")) as s3:

        async def part(key: str, uid: str, n: int, fd: int, offset: int, length: int) -> dict:
            try:
                data = await asyncio.to_thread(os.pread, fd, length, offset)
                r = await s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=n, Body=data)
            finally:
                slots.release()
            return {"PartNumber": n, "ETag": r["ETag"]}

        async def one(path: Path) -> None:
            key = f"{prefix}/{path.relative_to(root).as_posix()}"
            size = path.stat().st_size
            psize = part_size_for(size, chunk_size, cfg)
            fd = os.open(path, os.O_RDONLY)
            try:
                if size <= psize:
                    async with slots:
                        data = await asyncio.to_thread(os.pread, fd, size, 0)
                        await s3.put_object(Bucket=bucket, Key=key, Body=data)
                    return
                uid = (await s3.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
                sent = []
                for n, offset in enumerate(range(0, size, psize), start=1):
                    await slots.acquire()
                    sent.append(asyncio.ensure_future(part(key, uid, n, fd, offset, min(psize, size - offset))))
                parts = await asyncio.gather(*sent)
                await s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid,
                                                   MultipartUpload={"Parts": list(parts)})
            finally:
                os.close(fd)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in mf.list_files(root)))
        return time.perf_counter() - t0
