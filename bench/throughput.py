"""`weightcast bench throughput`: what a byte costs in peerd. One peerd serves a version it already
holds (seeded from the origin before the clock starts) to ``downloaders`` peerd processes at once; no
rate limit, no origin during the measured transfer (the downloaders are given no origin, so every
byte comes from the serving peer). Reported per process: MiB/s, and CPU-seconds per GiB moved from
/proc (user + system of the peerd process alone), against the cost of the manifest's digest alone on
this machine (the floor a verifying receiver cannot go below): SHA-256, or BLAKE3 with ``--hash blake3``. Timed: from the job submissions to every downloader
holding the whole version verified and durable (bitmap and files fsync'ed). Put TMPDIR on tmpfs
(/dev/shm) to measure peerd and not the disk.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from peerd import digests
from peerd import manifest as mf
from peerd.client import PeerdClient
from peerd.origin import OriginSpec, S3Origin
from peerd.signing import generate_keypair, load_private_key
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from weightcast.stack.ports import free_ports
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3

GIB = 1 << 30


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (from /proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hash_cpu_s_per_gib(algorithm: str = mf.HASH_ALGORITHM, sample: int = 256 << 20) -> float:
    data = os.urandom(1 << 20)
    t0 = time.process_time()
    h = digests.new(algorithm)
    for _ in range(sample >> 20):
        h.update(data)
    return (time.process_time() - t0) * GIB / sample


async def run_throughput_bench(size: int, chunk: int, downloaders: int, timeout: float = 600.0,
                               algorithm: str = mf.HASH_ALGORITHM) -> dict:
    work = Path(tempfile.mkdtemp(prefix="wc-tput-"))
    s3 = SeaweedS3(work / "s3").start()
    procs: list[PeerdProc] = []
    try:
        ckpt = write_random_checkpoint(work / "ckpt", size, files=4)
        generate_keypair(work / "key.pem", work / "key.pub")
        m = mf.build_from_directory(ckpt, "bench", "v1", chunk, algorithm)
        signed = mf.sign_manifest(m, load_private_key(work / "key.pem"))
        spec = OriginSpec(s3.endpoint, s3.bucket, "tput/v1")
        async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
            await o.ensure_bucket()
            await o.upload_directory(ckpt)
        shutil.rmtree(ckpt)                         # the bytes live in S3 and, soon, in the server's store
        token = secrets.token_hex(16)
        ids = ["server", *[f"d{i}" for i in range(downloaders)]]
        ports = dict(zip(ids, free_ports(len(ids))))
        procs = [PeerdProc(i, ports[i], work / i / "store", fleet_args(i, ports, token=token,
                 trusted_key=work / "key.pub", rate=None, origin_rate=None), env=s3.env()) for i in ids]
        for p in procs:
            p.start()
        server, *down = procs
        async with PeerdClient(server.addr, token) as c:     # seed the server (not timed)
            await c.start_job(signed, {"endpoint": s3.endpoint, "bucket": s3.bucket, "prefix": "tput/v1"}, [server.id])
            st = await c.wait(m.digest, timeout)
            if st["state"] != "complete":
                raise RuntimeError(f"the serving peer could not seed the version: {st.get('error')}")
        s3.stop()                                   # nothing else may feed the downloaders
        await asyncio.sleep(1.0)                    # gossip: every downloader knows the server holds it all
        cpu0 = {p.id: cpu_seconds(p.proc.pid) for p in procs}
        clients = [PeerdClient(p.addr, token) for p in down]
        for c in clients:
            await c.__aenter__()
        t0 = time.monotonic()
        await asyncio.gather(*(c.start_job(signed, None, []) for c in clients))
        finals = await asyncio.gather(*(c.wait(m.digest, timeout, poll=0.05) for c in clients))
        wall = time.monotonic() - t0
        cpu = {p.id: cpu_seconds(p.proc.pid) - cpu0[p.id] for p in procs}
        for c in clients:
            await c.__aexit__(None, None, None)
        failed = {p.id: st.get("error") for p, st in zip(down, finals) if st["state"] != "complete"}
        gib = m.total_size / GIB
        per_down = [{"host": p.id, "seconds": round(st["finished"] - st["started"], 3),
                     "mib_per_s": round(m.total_size / (1 << 20) / max(1e-9, st["finished"] - st["started"]), 1),
                     "cpu_s": round(cpu[p.id], 2), "cpu_s_per_gib_received": round(cpu[p.id] / gib, 2),
                     "from_peer_bytes": st["bytes_by_source"]["peer"]}
                    for p, st in zip(down, finals) if st["state"] == "complete"]
        hash_floor = hash_cpu_s_per_gib(algorithm)
        return {"size": m.total_size, "chunk": chunk, "chunks": len(m.chunks), "downloaders": downloaders,
                "hash_algorithm": algorithm,
                "wall_s": round(wall, 3), "aggregate_mib_per_s": round(downloaders * m.total_size / (1 << 20) / wall, 1),
                "server": {"cpu_s": round(cpu["server"], 2),
                           "cpu_s_per_gib_sent": round(cpu["server"] / (gib * downloaders), 2)},
                "downloaders_detail": per_down, "failed": failed,
                "hash_cpu_s_per_gib": round(hash_floor, 2),
                "downloader_cpu_over_hash_floor": round(sum(d["cpu_s_per_gib_received"] for d in per_down)
                                                        / max(1, len(per_down)) / hash_floor, 2) if per_down else None,
                "cores": os.cpu_count(), "tmpdir": tempfile.gettempdir(),
                "includes": f"submit to every downloader complete: receive, {algorithm} of every byte, pwrite, "
                            "fdatasync of chunk and bitmap, gossip; CPU of the peerd processes only"}
    finally:
        for p in procs:
            p.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
