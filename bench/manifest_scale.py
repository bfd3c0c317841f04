"""`weightcast bench manifest`: what a manifest of a real checkpoint's shape costs: build and sign
(publisher), parse + validate + signature check (every host and the control worker), laying the
version out in the store, and the per-status and per-gossip work that scales with the chunk count.

Each size runs in a fresh child process so its peak RSS is its own. Chunk digests are random (no
bytes are hashed: this measures the manifest, not the checkpoint); chunks are 16 bytes so a 400,000-
chunk version lays out in 6 MB of disk, with the shape (files x chunks) of a real one."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import secrets
import tempfile
import time
from pathlib import Path


def _measure(chunks: int, files: int, out) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from peerd import manifest as mf
    from peerd.store import ChunkStore
    from peerd.wire import pack_bits
    key = Ed25519PrivateKey.generate()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    per_file = chunks // files
    fentries, centries = [], []
    for i in range(files):
        n = per_file if i < files - 1 else chunks - per_file * (files - 1)
        path = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        fentries.append(mf.FileEntry(path, 16 * n, secrets.token_hex(32)))
        base = len(centries)
        centries += [mf.Chunk(base + k, path, 16 * k, 16, secrets.token_hex(32)) for k in range(n)]
    m = mf.assemble("bench", "v1", 16, fentries, centries)
    raw = mf.signed_bytes(m, key)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    parsed = mf.load_signed(raw, [key.public_key()])
    verify_s = time.perf_counter() - t
    t = time.perf_counter()
    vid = parsed.digest
    digest_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="wc-manifest-") as d:
        t = time.perf_counter()
        vs = ChunkStore(Path(d)).open_version(parsed, raw)
        layout_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(10):
            vs.verified_bytes()
            vs.done_chunks
        status_s = (time.perf_counter() - t) / 10
        t = time.perf_counter()
        for _ in range(10):
            pack_bits(vs.bits)
        gossip_s = (time.perf_counter() - t) / 10
        vs.close()
    out.send({"chunks": chunks, "files": files, "manifest_bytes": len(raw), "version_id": vid,
              "build_and_sign_s": round(build_s, 3), "parse_validate_verify_s": round(verify_s, 3),
              "digest_s_cached": round(digest_s, 6), "store_layout_s": round(layout_s, 3),
              "status_s": round(status_s, 6), "gossip_bitmap_s": round(gossip_s, 6),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "rss_before_mb": round(rss0 / 1024, 1)})


def run_manifest_bench(sizes: list[int], files: int = 64) -> dict:
    ctx = mp.get_context("spawn")
    rows = []
    for n in sizes:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_measure, args=(n, files, child))
        p.start()
        child.close()                  # so a child that dies ends recv() with EOFError, not a hang
        try:
            rows.append(parent.recv())
        except EOFError:
            raise RuntimeError(f"the measuring process for {n} chunks died ({p.exitcode}); see its traceback") from None
        finally:
            p.join()
    return {"what": "per size, a fresh process: build+sign (publisher), parse+validate+verify (host), "
                    "store layout, status and gossip bitmap work per call; peak RSS of that process",
            "cpu": os.cpu_count(), "rows": rows}


def main_json(sizes: list[int]) -> str:
    return json.dumps(run_manifest_bench(sizes), indent=1)
