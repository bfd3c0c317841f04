"""`weightcast bench router`: what the serving path adds to time-to-first-token. Streamed completions
(``stream: true``) of a small Llama (built here, bf16, golden prompts), alternately through the router
(router → model server → engine) and to the engine's own OpenAI API directly, in one run.

- ``engine=vllm``: "direct" is the vLLM server itself; through the router a request also passes the
  router and the model server, which proxies it to that same vLLM server.
- ``engine=transformers``: "direct" is the model server's OpenAI endpoint (the engine runs inside it).

TTFT is from sending the request to the first streamed piece of text. Requests run one at a time,
alternating, so both paths see the same engine and the same machine; the router and the model server
run in this process's event loop, as the client does, so the ratio includes their CPU.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Literal

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.engine import stored_version
from serving import hf_build
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app, make_engine
from weightcast.stack.embedded import serve_app

EngineName = Literal["vllm", "transformers"]
ADMIN = "bench-admin"


async def _ttft(http: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Seconds to the first streamed piece of text; the rest of the stream is read to its end."""
    t0 = time.perf_counter()
    first = None
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no text")
    return first


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


async def _run(engine_name: EngineName, requests: int, work: Path) -> dict:
    src = hf_build.build("llama", work / "src")
    model_dir = stored_version(src, work / "store", "v1", Ed25519PrivateKey.generate())
    ms = ModelServer("h1", engine=make_engine(engine_name, work / "vllm"), store_root=work / "store",
                     admin_token=ADMIN)
    runners = []
    try:
        vs = await ms.load(("bench", "v1"), model_dir)
        if vs.state != "ready":
            raise RuntimeError(f"the model did not load: {vs.code}: {vs.reason}")
        r, ms_addr = await serve_app(server_app(ms))
        runners.append(r)
        router = Router(poll_interval=1.0, admin_token=ADMIN)
        r, router_addr = await serve_app(router_app(router))
        runners.append(r)
        router.table.add_host("bench", "h1", ms_addr)
        router.table.add_version("bench", "v1")
        await router.poll_once()
        router.table.set_weights("bench", {"v1": 100})
        if engine_name == "vllm":
            direct = ms.engine.hf.openai_base(("bench", "v1")) + "/v1/completions"
        else:
            direct = ms_addr + "/v1/completions"
        routed = router_addr + "/v1/completions"
        body = {"model": "bench", "prompt": "The list type", "max_tokens": 4, "temperature": 0, "stream": True}
        direct_body = {**body, **({"model_version": "v1"} if engine_name == "transformers" else {})}
        times: dict[str, list[float]] = {"direct": [], "router": []}
        async with aiohttp.ClientSession() as http:
            for _ in range(10):                                    # warm both paths (connections, caches)
                await _ttft(http, direct, direct_body)
                await _ttft(http, routed, body)
            for i in range(requests):
                for path in (("direct", "router") if i % 2 == 0 else ("router", "direct")):
                    url, b = (direct, direct_body) if path == "direct" else (routed, body)
                    times[path].append(await _ttft(http, url, b))
        p50 = {k: statistics.median(v) for k, v in times.items()}
        return {"engine": engine_name, "model": "llama (serving/hf_build.py TINY, bf16)", "requests": requests,
                "ttft_p50_ms": {k: round(v * 1e3, 2) for k, v in p50.items()},
                "ttft_p90_ms": {k: round(_pct(v, 0.9) * 1e3, 2) for k, v in times.items()},
                "router_over_direct_p50": round(p50["router"] / p50["direct"], 3),
                "router_added_ms_p50": round((p50["router"] - p50["direct"]) * 1e3, 2),
                "direct": "vLLM's own server" if engine_name == "vllm" else "the model server's OpenAI endpoint"}
    finally:
        for r in reversed(runners):
            await r.cleanup()
        ms.engine.stop_all()


def run_router_bench(engine_name: EngineName = "vllm", requests: int = 200, workdir: Path | None = None) -> dict:
    work = Path(workdir or tempfile.mkdtemp(prefix="wc-router-"))
    try:
        return asyncio.run(_run(engine_name, requests, work))
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
