"""`weightcast gpu-check` (`make gpu-check`): what a CUDA host must show before a fleet trusts it, as
one JSON document.

- ``load``: the verified load of a Hugging Face Llama directory (bf16, ~512 MiB) to the GPU, in GB/s,
  against a page-cache read of the same files and a pinned host-to-device copy (same run).
- ``engines``: a small trained Llama, published with golden prompts, made ready in bf16 by the
  transformers engine on the GPU and by vLLM (when its virtualenv has a CUDA build:
  ``make vllm-venv VLLM_PACKAGE=vllm==<version>``): each must reproduce the golden prompts.
- ``rollout``: the same checkpoint through publish → RolloutWorkflow → peerd → the model servers on
  the GPU → the router, answered through the OpenAI API.

Exit status: 0 when every part passed, 1 when one failed, 2 without a CUDA device (nothing to check).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch


def _part(fn, *args) -> dict:
    t0 = time.monotonic()
    try:
        return {"ok": True, **fn(*args), "seconds": round(time.monotonic() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - one part failing must not hide the others' results
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)[-1500:],
                "seconds": round(time.monotonic() - t0, 1)}


def _load(work: Path) -> dict:
    from bench.load import run_load_bench
    r = run_load_bench(512 << 20, repeats=3, workdir=work / "load", engine="transformers")
    return {k: r[k] for k in ("size_bytes", "device", "load_gbps", "pagecache_read_gbps", "load_over_read",
                              "h2d_gbps", "hash_bound_gbps", "load_over_hash_bound")}


def _engines(work: Path) -> dict:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from bench.engine import stored_version
    from serving import hf_build
    from serving.engine import VersionKey
    from serving.hf_engine import TransformersEngine
    from serving.vllm_engine import VllmEngine, vllm_python
    d = stored_version(hf_build.build("llama", work / "src"), work / "store", "v1", Ed25519PrivateKey.generate())
    out = {}
    engine = TransformersEngine()
    t0 = time.monotonic()
    engine.load(VersionKey("bench", "v1"), d, None, 0)          # raises unless the golden prompts match
    out["transformers"] = {"device": engine.device(), "ready_s": round(time.monotonic() - t0, 2), "golden_ok": True}
    if not Path(vllm_python()).exists():
        out["vllm"] = {"ok": False, "error": f"no vLLM at {vllm_python()}: make vllm-venv "
                                             "VLLM_PACKAGE=vllm==<version> (the CUDA build)"}
        return out
    v = VllmEngine(work / "vllm")
    try:
        t0 = time.monotonic()
        v.load(VersionKey("bench", "v1"), d, None, 0)
        out["vllm"] = {"ready_s": round(time.monotonic() - t0, 2), "golden_ok": True}
    finally:
        v.stop_all()
    return out


def _rollout(work: Path) -> dict:
    return asyncio.run(_rollout_async(work))


async def _rollout_async(work: Path) -> dict:
    import openai

    from peerd.origin import OriginSpec
    from serving import golden, hf_build
    from peerd.signing import generate_keypair
    from weightcast.publish import PublishRequest, publish_and_start
    from weightcast.stack.embedded import EmbeddedStack
    from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
    priv, pub = work / "signing.pem", work / "signing.pub"
    generate_keypair(priv, pub)
    src = hf_build.build("llama", work / "rollout-src")
    record = golden.record(src)
    stack = await EmbeddedStack(work / "stack", pub, ["a", "b"]).start()
    try:
        req = PublishRequest(src, "llama", "v1", priv, OriginSpec(stack.s3.endpoint, stack.s3.bucket, "llama/v1"),
                             access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        t0 = time.monotonic()
        started = await publish_and_start(stack.client, req, stack.hosts, router=stack.router_addr, step_wait_s=0.0)
        result = await stack.client.get_workflow_handle(started["workflow_id"]).result()
        seconds = time.monotonic() - t0
        devices = {h: ms.engine.device() for h, ms in stack.model_servers.items()}
        client = openai.AsyncOpenAI(base_url=f"{stack.router_addr}/v1", api_key="none", max_retries=0)
        p = record["prompts"][0]
        answer = await client.completions.create(model="llama", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                 temperature=0)
        await client.close()
        eos = hf_build.tokenizer().eos_token_id
        ids = p["output_ids"][:p["output_ids"].index(eos)] if eos in p["output_ids"] else p["output_ids"]
        want = hf_build.tokenizer().decode(ids, skip_special_tokens=True)
        if answer.choices[0].text != want:
            raise RuntimeError(f"the router answered {answer.choices[0].text!r}, the golden completion is {want!r}")
        return {"ready": result["ready"], "devices": devices, "rollout_s": round(seconds, 1),
                "answer_matches_golden": True}
    finally:
        await stack.stop()


def run_gpu_check(workdir: Path | None = None) -> tuple[int, dict]:
    if not torch.cuda.is_available():
        return 2, {"ok": False, "error": "no CUDA device: torch.cuda.is_available() is False "
                                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                                         "run this on a GPU host with a CUDA build of torch"}
    work = Path(workdir or tempfile.mkdtemp(prefix="wc-gpu-check-"))
    try:
        props = torch.cuda.get_device_properties(0)
        doc = {"device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                          "torch": torch.__version__, "cuda": torch.version.cuda},
               "load": _part(_load, work), "engines": _part(_engines, work), "rollout": _part(_rollout, work)}
        doc["ok"] = all(doc[k]["ok"] for k in ("load", "engines", "rollout"))
        return (0 if doc["ok"] else 1), doc
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    code, doc = run_gpu_check()
    print(json.dumps(doc, indent=1))
    return code
