"""Helpers for serving tests: real checkpoints of the reference model, verified the way peerd does it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from peerd import manifest as mf
from peerd.manifest_fetch import pinned_document
from peerd.store import ChunkStore
from serving.checkpoint import write_checkpoint
from serving.model_config import ModelConfig

SMALL = ModelConfig(vocab=512, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq=32)


def verified_version(tmp: Path, version: str, seed: int, key, config: ModelConfig = SMALL,
                     tamper=None, algorithm: str = mf.HASH_ALGORITHM, model: str = "tiny", pinned: bool = False) -> Path:
    """Write a checkpoint, put it through peerd's store (every chunk verified), return the model dir.

    ``tamper(src_dir)`` may change the files before the manifest is built (a bad but signed checkpoint)."""
    src = write_checkpoint(tmp / f"src-{model}-{version}", config, seed, shard_bytes=64 * 1024, version=version)
    if tamper:
        tamper(src)
    out = store_version(tmp, src, model, version, key, algorithm=algorithm, pinned=pinned)
    shutil.rmtree(src)
    return out


def store_version(tmp: Path, src: Path, model: str, version: str, key, serving: dict | None = None,
                  algorithm: str = mf.HASH_ALGORITHM, pinned: bool = False) -> Path:
    """``src`` signed as (model, version) (``serving``: the manifest's serving record) and put through
    peerd's store under ``tmp``, every chunk verified; the model directory there. ``pinned``: stored
    unsigned, as peerd stores a training checkpoint submitted on the cluster token's word."""
    m = mf.build_from_directory(src, model, version, chunk_size=32 * 1024, algorithm=algorithm, serving=serving)
    store = ChunkStore(store_root(tmp))
    doc = pinned_document(m.body()) if pinned else json.dumps(mf.sign_manifest(m, key)).encode()
    vs = store.open_version(m, doc)
    vs.import_files(src)
    vs.write_verified()
    vs.close()
    return vs.model_dir


def store_root(tmp: Path) -> Path:
    """The one peerd store that test versions live in (model servers load only from under it)."""
    return tmp / "store"


async def publish_hf(stack, seaweed, keys, src: Path, model: str, version: str) -> dict:
    """``src`` through `weightcast publish` (golden prompts recorded) and its rollout on ``stack`` to the
    end; the workflow's result."""
    from peerd.origin import OriginSpec
    from weightcast.publish import PublishRequest, publish_and_start
    from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
    req = PublishRequest(src, model, version, keys["priv_path"],
                         OriginSpec(seaweed.endpoint, seaweed.bucket, f"{stack.engine}/{model}/{version}"),
                         chunk_size=64 * 1024, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    out = await publish_and_start(stack.client, req, stack.hosts, router=stack.router_addr, step_wait_s=0.0)
    return await stack.client.get_workflow_handle(out["workflow_id"]).result()
