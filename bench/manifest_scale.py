"""`weightcast bench manifest`: what a manifest of a real checkpoint's shape costs: build and sign
(publisher), parse + validate + signature check (every host and the control worker), laying the
version out in the store, and the per-status and per-gossip work that scales with the chunk count.

Publisher and host run in fresh child processes so each peak RSS is its own. Chunk digests are random (no
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


def _peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _publisher(chunks: int, files: int, path: str, out) -> None:
    """Build and sign a manifest of this shape; write the signed document to ``path``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cryptography.hazmat.primitives import serialization

    from peerd import manifest as mf
    key = Ed25519PrivateKey.generate()
    t = time.perf_counter()
    per_file = chunks // files
    fentries, centries = [], []
    for i in range(files):
        n = per_file if i < files - 1 else chunks - per_file * (files - 1)
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        fentries.append(mf.FileEntry(name, 16 * n, secrets.token_hex(32)))
        base = len(centries)
        centries += [mf.Chunk(base + k, name, 16 * k, 16, secrets.token_hex(32)) for k in range(n)]
    raw = mf.signed_bytes(mf.assemble("bench", "v1", 16, fentries, centries), key)
    build_s = time.perf_counter() - t
    Path(path).write_bytes(raw)
    out.send({"manifest_bytes": len(raw), "build_and_sign_s": round(build_s, 3),
              "publisher_peak_rss_mb": _peak_mb(),
              "public_key": key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo)})


def _host(path: str, pem: bytes, out) -> None:
    """What a host (or the control worker) does with it: parse, validate, verify, lay out, report."""
    from peerd import manifest as mf
    from peerd.signing import load_public_key
    from peerd.store import ChunkStore
    from peerd.wire import pack_bits
    trusted = [load_public_key(pem)]
    rss0 = _peak_mb()
    raw = Path(path).read_bytes()
    t = time.perf_counter()
    m = mf.load_signed(raw, trusted)
    verify_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="wc-manifest-") as d:
        t = time.perf_counter()
        vs = ChunkStore(Path(d)).open_version(m, raw)
        layout_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(10):
            vs.verified_bytes()
        status_s = (time.perf_counter() - t) / 10
        t = time.perf_counter()
        for _ in range(10):
            pack_bits(vs.bits)
        gossip_s = (time.perf_counter() - t) / 10
        vs.close()
    out.send({"version_id": m.digest, "parse_validate_verify_s": round(verify_s, 3),
              "store_layout_s": round(layout_s, 3), "status_s": round(status_s, 6),
              "gossip_bitmap_s": round(gossip_s, 6), "host_peak_rss_mb": _peak_mb(),
              "host_rss_before_mb": rss0})


def _in_child(ctx, target, *args) -> dict:
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, child))
    p.start()
    child.close()                  # so a child that dies ends recv() with EOFError, not a hang
    try:
        return parent.recv()
    except EOFError:
        raise RuntimeError(f"the measuring process ({target.__name__}) died ({p.exitcode})") from None
    finally:
        p.join()


def run_manifest_bench(sizes: list[int], files: int = 64) -> dict:
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory(prefix="wc-manifest-") as d:
        for n in sizes:
            path = str(Path(d) / f"{n}.json")
            pub = _in_child(ctx, _publisher, n, files, path)
            pem = pub.pop("public_key")
            rows.append({"chunks": n, "files": files, **pub, **_in_child(ctx, _host, path, pem)})
    return {"what": "per size, fresh processes: the publisher builds and signs; a host parses, validates and "
                    "verifies the signature, lays the version out in its store, and computes status and the "
                    "gossip bitmap (per call); peak RSS of each process",
            "cpu": os.cpu_count(), "rows": rows}


def main_json(sizes: list[int]) -> str:
    return json.dumps(run_manifest_bench(sizes), indent=1)
