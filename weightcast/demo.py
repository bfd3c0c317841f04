"""`weightcast demo` (what `make demo` runs): a real end-to-end rollout on loopback.

1. writes a real checkpoint of the reference transformer (sharded safetensors + smoke material);
2. publishes it to SeaweedFS, signs its manifest and distributes it to N peerd hosts through the
   swarm, rate-limited, with a live progress bar;
3. loads the verified files on each host's model server (smoke-tested, fail closed);
4. registers the hosts with the router, moves 100% of the traffic to the version once it is ready
   everywhere, and sends an inference request through the router, checking the answer against the
   reference weights.
The Temporal control plane that will drive steps 2–4 as a durable workflow is not built yet.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch

from bench.swarm import SwarmBenchConfig, run_swarm_bench
from serving.checkpoint import write_checkpoint
from serving.model import ModelConfig, init_model
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app


async def _serve(app):
    from aiohttp import web
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def run_demo(hosts: int, size: int, rate: float, progress) -> dict:
    work = Path(tempfile.mkdtemp(prefix="wc-demo-"))
    mcfg = ModelConfig.for_size(size)
    seed, version = 7, "v1"
    runners = []
    try:
        cfg = SwarmBenchConfig(hosts=hosts, size=size, rate=rate, chunk=1 << 20, workdir=work, model="demo",
                               version=version,
                               checkpoint=lambda d: write_checkpoint(d, mcfg, seed, shard_bytes=16 << 20, version=version))
        swarm = await run_swarm_bench(cfg, progress)
        print(f"swarm: {swarm['max_s']:.1f}s for {swarm['size'] / 2**20:.0f} MiB to {hosts} hosts "
              f"({swarm['ratio']:.2f}x the lower bound), origin sent {swarm['origin_copies']:.2f} copies",
              file=sys.stderr)
        router = Router(poll_interval=0.1)
        rr, raddr = await _serve(router_app(router))
        runners.append(rr)
        addrs = {}
        async with aiohttp.ClientSession() as s:
            for i in range(hosts):
                r, addrs[f"h{i}"] = await _serve(server_app(ModelServer(f"h{i}")))
                runners.append(r)
                model_dir = work / "hosts" / f"h{i}" / "store" / "versions" / swarm["version_id"] / "model"
                async with s.post(addrs[f"h{i}"] + "/v1/load", json={"model_version": version, "path": str(model_dir)}) as resp:
                    body = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"h{i} could not load {version}: {body}")
            async with s.put(raddr + "/admin/models/demo/hosts", json=addrs) as resp:
                resp.raise_for_status()
            async with s.post(raddr + "/admin/models/demo/versions", json={"version": version}) as resp:
                resp.raise_for_status()
            async with s.put(raddr + "/admin/models/demo/weights", json={"weights": {version: 100}}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"router refused the traffic shift: {body}")
            ids = [[1, 2, 3, 4, 5]]
            async with s.post(raddr + "/v1/models/demo/infer", json={"input_ids": ids}) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"inference through the router failed: {answer}")
        with torch.no_grad():
            want = init_model(mcfg, seed)(torch.tensor(ids))[:, -1, :16]
        correct = bool(torch.allclose(torch.tensor(answer["logits_head"]), want, atol=1e-4))
        return {"swarm": {k: swarm[k] for k in ("hosts", "size", "lower_bound_s", "max_s", "ratio", "origin_copies",
                                                 "all_verified", "corrupt_chunks_accepted")},
                "inference": {"routed_host": answer["routed_host"], "model_version": answer["model_version"],
                              "next_token": answer["next_token"], "matches_reference_weights": correct},
                "ok": swarm["all_verified"] and correct}
    finally:
        for r in runners:
            await r.cleanup()
        shutil.rmtree(work, ignore_errors=True)
