"""`weightcast bench engine`: how long a host takes to make a new version ready in its engine, against
starting the engine cold, measured side by side in one run on two trainings of the same small Llama
(built here, bf16, sharded, with golden prompts).

- ``cold_start_s``: a plain engine started on the first version's directory until it answers one
  completion (vLLM: a fresh server process; transformers: a load in this process).
- ``reload_s``: from a verified version on the host's disk to that version ready in the running
  engine: every byte hashed against its manifest, the weights loaded (vLLM: ``reload_weights`` into
  a drained server), and the golden prompts reproduced. ``reload_over_cold`` is their ratio.
- vLLM only: ``start_ahead_s``, a server started on stand-in weights from a version's files but its
  weights (what a host does while the weights still arrive), then ``load_after_start_ahead_s``, the
  load that remains once the version is whole (hash, reload, golden prompts): the part of a cold
  start left on the rollout's path. ``ahead_load_over_cold`` is its ratio to the cold start.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peerd import manifest as mf
from peerd.store import ChunkStore
from serving import golden, hf_build
from serving.engine import VersionKey

EngineName = Literal["vllm", "transformers"]


def stored_version(src: Path, store: Path, version: str, key, model: str = "bench") -> Path:
    """``src`` published as (``model``, ``version``) with its golden prompts, through a peerd store."""
    m = mf.build_from_directory(src, model, version, chunk_size=1 << 20, serving={"golden": golden.record(src)})
    vs = ChunkStore(store).open_version(m, mf.signed_bytes(m, key))
    vs.import_files(src)
    vs.write_verified()
    vs.close()
    return vs.model_dir


def _plain_vllm_cold_start(engine, model_dir: Path) -> float:
    """A fresh vLLM server on ``model_dir`` until it answers one completion (then stopped)."""
    from lib.processes import stop_process
    from serving.footprint import kv_bytes_per_token
    config = (model_dir / "config.json").read_bytes()
    kv = engine.kv_cache_tokens * kv_bytes_per_token(json.loads(config), engine.dtype)
    t0 = time.monotonic()
    server = engine.start_server(VersionKey("bench", "cold"), model_dir, config, kv)
    try:
        req = urllib.request.Request(server.base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": 1}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
        return time.monotonic() - t0
    finally:
        stop_process(server.proc)


def _start_ahead(engine, work: Path, key, cold: float) -> dict:
    """Another model (so no idle server of its own waits): started ahead, then loaded."""
    d = stored_version(hf_build.build("llama", work / "src-ahead", seed=5), work / "store", "v1", key, "ahead")
    k = VersionKey("ahead", "v1")
    names = len(list(mf.list_files(work / "src-ahead")))
    t0 = time.monotonic()
    if not engine.warm(k, d, names, None, 0):
        raise RuntimeError("the engine did not start a server ahead")
    ahead = time.monotonic() - t0
    t0 = time.monotonic()
    engine.load(k, d, None, 0)                   # raises if the golden prompts fail
    load = time.monotonic() - t0
    return {"start_ahead_s": round(ahead, 4), "load_after_start_ahead_s": round(load, 4),
            "load_after_start_ahead_how": engine.last_load["how"], "ahead_load_over_cold": round(load / cold, 4)}


def run_engine_bench(engine_name: EngineName = "vllm", workdir: Path | None = None) -> dict:
    work = Path(workdir or tempfile.mkdtemp(prefix="wc-engine-"))
    key = Ed25519PrivateKey.generate()
    engine = None
    try:
        dirs = {v: stored_version(hf_build.build("llama", work / f"src-{v}", seed=i), work / "store", v, key)
                for i, v in enumerate(("v1", "v2"))}
        if engine_name == "vllm":
            from serving.vllm_engine import VllmEngine
            engine = VllmEngine(work / "vllm")
            cold = _plain_vllm_cold_start(engine, dirs["v1"])
            engine.load(VersionKey("bench", "v1"), dirs["v1"], None, 0)
            engine.unload(VersionKey("bench", "v1"))           # drained: its server waits for the next version
        else:
            from serving.hf_engine import TransformersEngine
            engine = TransformersEngine()
            t0 = time.monotonic()
            engine.load(VersionKey("bench", "v1"), dirs["v1"], None, 0)
            cold = time.monotonic() - t0
        t0 = time.monotonic()
        nbytes = engine.load(VersionKey("bench", "v2"), dirs["v2"], None, 0)   # raises if golden prompts fail
        reload_s = time.monotonic() - t0
        how = getattr(engine, "last_load", {}).get("how", "in_process")
        out = {"engine": engine_name, "model": "llama (serving/hf_build.py TINY, bf16)", "bytes": nbytes,
               "cold_start_s": round(cold, 4), "reload_s": round(reload_s, 4), "reload_how": how,
               "reload_over_cold": round(reload_s / cold, 4), "golden_ok": True,
               "reload_includes": "hash of every byte against the manifest + weights into the engine + golden prompts"}
        if engine_name == "vllm":
            out.update(_start_ahead(engine, work, key, cold))
        return out
    finally:
        if hasattr(engine, "stop_all"):           # vLLM servers go with the benchmark, however it ends
            engine.stop_all()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
