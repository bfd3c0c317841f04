"""`weightcast bench throughput`: what a byte costs in peerd. One peerd serves a version it already
holds (seeded from the origin before the clock starts) to ``downloaders`` peerd processes at once; no
rate limit, no origin during the measured transfer (the downloaders are given no origin, so every
byte comes from the serving peer). Timed: from the job submissions to every downloader holding the
whole version verified and durable (bitmap and files fsync'ed). Put TMPDIR on tmpfs (/dev/shm) to
measure peerd and not the disk.

Reported per process: MiB/s, and CPU-seconds per GiB moved from /proc (user + system of the peerd
process alone), split for a downloader into the stages peerd meters itself
(``peerd_store_cpu_seconds_total``): ``allocate`` (pre-allocating the version's files), ``hash``
(the manifest's digest of every byte), ``write`` (pwrite + fdatasync into the store) and ``receive``
(everything else: the socket reads, the event loop, the policy, gossip). Beside them, measured in the same run on this machine, the floors a
verifying receiver cannot go below: the digest alone, a bare pwrite of the same bytes into a fresh,
pre-allocated file on the store's filesystem (on a VM's tmpfs this varies from run to run), the
pre-allocation itself, and a bare loopback receive (sent with sendfile from a file, as a serving peerd
sends, into a rotation of resident chunk buffers, as peerd's pool), with ``total`` their sum and
``downloader_cpu_over_floor_total`` the downloader against it. ``loop_thread_cpu_s_per_gib`` is the
event loop's own thread: the one part of peerd that cannot spread over cores, so what bounds a host's
line rate (the chunk receives, digests and writes run in worker threads).

``warm_pages`` (default on): before the clock, the bench writes and frees as many bytes as the
downloaders will store, on the store's filesystem, so that peerd's writes land on memory the VM's host
already backs (see the comment in the code); ``write_cold`` in the floors is what that first write cost.

"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from peerd import digests
from peerd import manifest as mf
from peerd.client import PeerdClient
from peerd.origin import OriginSpec, S3Origin
from peerd.signing import generate_keypair, load_private_key
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from lib.ports import free_ports
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3

GIB = 1 << 30


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of one process, or of one of its threads (from /proc, in clock ticks)."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hash_cpu_s_per_gib(algorithm: str = mf.HASH_ALGORITHM, sample: int = 256 << 20) -> float:
    data = os.urandom(1 << 20)
    t0 = time.process_time()
    h = digests.new(algorithm)
    for _ in range(sample >> 20):
        h.update(data)
    return (time.process_time() - t0) * GIB / sample


def write_cpu_s_per_gib(directory: Path, size: int, piece: int = 4 << 20, writers: int = 1,
                        one_at_a_time: bool = True) -> float:
    """A bare pwrite of ``size`` bytes from resident buffers into a fresh, pre-allocated file in
    ``directory`` (the store's filesystem), as the store writes chunks; the file is removed after.
    The pre-allocation is not counted (peerd's is its own stage). ``writers`` threads take turns at
    the pieces; ``one_at_a_time`` serialises their pwrites with a lock, as the store does (unlocked,
    they meet on the file's inode lock in the kernel, which spins)."""
    bufs = [memoryview(os.urandom(piece)) for _ in range(writers)]
    path = directory / ".write-floor"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    lock = threading.Lock() if one_at_a_time else contextlib.nullcontext()

    def write(k: int) -> None:
        for off in range(k * piece, size, piece * writers):
            with lock:
                os.pwrite(fd, bufs[k][:min(piece, size - off)], off)

    try:
        os.posix_fallocate(fd, 0, size)
        t0 = time.process_time()
        threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.fdatasync(fd)
        return (time.process_time() - t0) * GIB / size
    finally:
        os.close(fd)
        path.unlink()


def allocate_cpu_s_per_gib(directory: Path, size: int) -> float:
    """``posix_fallocate`` of a fresh ``size``-byte file in ``directory``, as the store pre-allocates a
    version (on tmpfs this allocates the pages; on ext4/xfs it only reserves extents)."""
    path = directory / ".allocate-floor"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.process_time()
        os.posix_fallocate(fd, 0, size)
        return (time.process_time() - t0) * GIB / size
    finally:
        os.close(fd)
        path.unlink()


_SENDER = """
import os, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
fd, size, off = os.open(sys.argv[2], os.O_RDONLY), int(sys.argv[3]), 0
while off < size:
    off += os.sendfile(s.fileno(), fd, off, size - off)
s.close()
"""


def receive_cpu_s_per_gib(directory: Path, size: int, piece: int = 4 << 20, buffers: int = 12) -> float:
    """A bare loopback TCP receive of ``size`` bytes, sent with sendfile from a file in ``directory``
    (as a serving peerd sends), into a rotation of ``buffers`` resident chunk-size buffers (as peerd's
    pool), with blocking ``recv_into(MSG_WAITALL)``; this process's CPU only."""
    path = directory / ".receive-floor"
    with open(path, "wb") as f:
        for _ in range(0, size, 1 << 20):
            f.write(os.urandom(1 << 20))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(30)          # a sender that never connects or stalls fails the bench, not hangs it
        sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(srv.getsockname()[1]), str(path),
                                   str(os.path.getsize(path))])
        try:
            conn, _ = srv.accept()
            conn.settimeout(30)
            pool = [memoryview(bytearray(b"\1" * piece)) for _ in range(buffers)]
            got, i, t0 = 0, 0, time.process_time()
            with conn:
                while got < size:
                    n = conn.recv_into(pool[i % buffers], min(piece, size - got), socket.MSG_WAITALL)
                    if not n:
                        raise RuntimeError("the floor's sender stopped early")
                    got, i = got + n, i + 1
            return (time.process_time() - t0) * GIB / size
        finally:
            path.unlink()
            try:
                sender.wait(30)
            except subprocess.TimeoutExpired:
                sender.kill()
                sender.wait()


async def stage_cpu(client: PeerdClient) -> dict[str, float]:
    """The CPU seconds one peerd's store has metered itself, by stage (peerd_store_cpu_seconds_total)."""
    return {stage: await client.metric(f'peerd_store_cpu_seconds_total{{stage="{stage}"}}')
            for stage in ("allocate", "hash", "write")}


async def run_throughput_bench(size: int, chunk: int, downloaders: int, timeout: float = 600.0,
                               algorithm: str = mf.HASH_ALGORITHM, warm_pages: bool = True) -> dict:
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
        procs = [PeerdProc(i, ports[i], work / i / "store", fleet_args(i, ports, trusted_key=work / "key.pub", rate=None,
                 origin_rate=None), env=s3.env(), token=token) for i in ids]
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
        floor_sample = min(m.total_size, 256 << 20)     # floors sampled on this machine, before the clock
        hash_floor = hash_cpu_s_per_gib(algorithm)
        receive_floor = receive_cpu_s_per_gib(down[0].store, floor_sample)
        # A VM's memory is backed by its host on first touch: writing pages the guest has not used lately
        # costs ~10x more (1.9 against 0.17 CPU-s/GiB for the same 4 GiB of pwrites here), charged to
        # whichever copy touches them. Writing the downloaders' bytes once and freeing them first
        # leaves the guest holding backed pages, so the clock measures peerd; the cold figure is reported.
        cold_write = write_cpu_s_per_gib(down[0].store, m.total_size * downloaders) if warm_pages else None
        write_floor = write_cpu_s_per_gib(down[0].store, floor_sample)
        allocate_floor = allocate_cpu_s_per_gib(down[0].store, floor_sample)
        # why the store writes one chunk at a time per file: two writers of one file, with and without
        two_writers = {"locked": write_cpu_s_per_gib(down[0].store, floor_sample, writers=2),
                       "unlocked": write_cpu_s_per_gib(down[0].store, floor_sample, writers=2, one_at_a_time=False)}
        clients = [PeerdClient(p.addr, token) for p in down]
        for c in clients:
            await c.__aenter__()
        stages0 = [await stage_cpu(c) for c in clients]
        cpu0 = {p.id: cpu_seconds(p.proc.pid) for p in procs}
        loop0 = {p.id: cpu_seconds(p.proc.pid, tid=p.proc.pid) for p in procs}   # the event loop's thread
        t0 = time.monotonic()
        await asyncio.gather(*(c.start_job(signed, None, []) for c in clients))
        finals = await asyncio.gather(*(c.wait(m.digest, timeout, poll=0.05) for c in clients))
        wall = time.monotonic() - t0
        cpu = {p.id: cpu_seconds(p.proc.pid) - cpu0[p.id] for p in procs}
        loop_cpu = {p.id: cpu_seconds(p.proc.pid, tid=p.proc.pid) - loop0[p.id] for p in procs}
        stages = [{k: v - s0[k] for k, v in (await stage_cpu(c)).items()} for c, s0 in zip(clients, stages0)]
        for c in clients:
            await c.__aexit__(None, None, None)
        failed = {p.id: st.get("error") for p, st in zip(down, finals) if st["state"] != "complete"}
        gib = m.total_size / GIB
        per_down = [{"host": p.id, "seconds": round(st["finished"] - st["started"], 3),
                     "mib_per_s": round(m.total_size / (1 << 20) / max(1e-9, st["finished"] - st["started"]), 1),
                     "cpu_s": round(cpu[p.id], 2), "cpu_s_per_gib_received": round(cpu[p.id] / gib, 2),
                     "loop_thread_cpu_s_per_gib": round(loop_cpu[p.id] / gib, 2),
                     "stages_cpu_s_per_gib": {"allocate": round(sg["allocate"] / gib, 2),
                                              "hash": round(sg["hash"] / gib, 2), "write": round(sg["write"] / gib, 2),
                                              "receive": round((cpu[p.id] - sum(sg.values())) / gib, 2)},
                     "from_peer_bytes": st["bytes_by_source"]["peer"]}
                    for p, st, sg in zip(down, finals, stages) if st["state"] == "complete"]
        mean = lambda key: sum(d["stages_cpu_s_per_gib"][key] for d in per_down) / len(per_down)
        floors = {"hash": round(hash_floor, 2), "write": round(write_floor, 2), "receive": round(receive_floor, 2),
                  "allocate": round(allocate_floor, 2),
                  "total": round(hash_floor + write_floor + receive_floor + allocate_floor, 2),
                  "sample_bytes": floor_sample, "write_cold": round(cold_write, 2) if warm_pages else None,
                  "write_two_writers_one_file": {k: round(v, 2) for k, v in two_writers.items()}}
        return {"size": m.total_size, "chunk": chunk, "chunks": len(m.chunks), "downloaders": downloaders,
                "hash_algorithm": algorithm, "warm_pages": warm_pages,
                "wall_s": round(wall, 3), "aggregate_mib_per_s": round(downloaders * m.total_size / (1 << 20) / wall, 1),
                "server": {"cpu_s": round(cpu["server"], 2),
                           "cpu_s_per_gib_sent": round(cpu["server"] / (gib * downloaders), 2),
                           "loop_thread_cpu_s_per_gib_sent": round(loop_cpu["server"] / (gib * downloaders), 2)},
                "downloaders_detail": per_down, "failed": failed,
                "hash_cpu_s_per_gib": round(hash_floor, 2),
                "floors_cpu_s_per_gib": floors,
                "downloader_cpu_over_hash_floor": round(sum(d["cpu_s_per_gib_received"] for d in per_down)
                                                        / max(1, len(per_down)) / hash_floor, 2) if per_down else None,
                # each stage against its own floor: what peerd adds on top of the kernel and the digest
                "downloader_stage_over_floor": {k: round(mean(k) / max(floors[k], 1e-9), 2)
                                                for k in ("allocate", "hash", "write", "receive")} if per_down else None,
                # the whole downloader against the sum of the floors: how near a bare receive-hash-write it is
                "downloader_cpu_over_floor_total": round(sum(d["cpu_s_per_gib_received"] for d in per_down)
                                                         / len(per_down) / floors["total"], 2) if per_down else None,
                # a swarm host receives one copy and serves about one: DESIGN.md's per-host figure
                "host_cpu_s_per_gib_received_and_served": round(
                    sum(d["cpu_s_per_gib_received"] for d in per_down) / len(per_down)
                    + cpu["server"] / (gib * downloaders), 2) if per_down else None,
                # what is left when the filesystem's own cost (allocating and filling pages) is taken out
                "downloader_cpu_s_per_gib_without_store_io": round(sum(d["cpu_s_per_gib_received"]
                                                                       - d["stages_cpu_s_per_gib"]["write"]
                                                                       - d["stages_cpu_s_per_gib"]["allocate"]
                                                                       for d in per_down) / len(per_down), 2)
                if per_down else None,
                "cores": os.cpu_count(), "tmpdir": tempfile.gettempdir(),
                "includes": f"submit to every downloader complete: receive, {algorithm} of every byte, pwrite, "
                            "fdatasync of chunk and bitmap, gossip; CPU of the peerd processes only; floors "
                            "sampled in this process before the clock starts"}
    finally:
        for p in procs:
            p.stop()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
