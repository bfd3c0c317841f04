"""`weightcast demo` (what `make demo` runs): training and a real rollout end to end, on loopback.

1. starts the embedded stack: the Temporal dev server (UI on), SeaweedFS, N hosts (peerd + model
   server + host worker, links rate-limited), the router and the control worker;
2. trains a small Llama on the standard library's sources as a durable TrainingWorkflow on two
   hosts, kills one rank mid-run (it is recovered from the newest complete checkpoint), exports a
   Hugging Face directory, and the same workflow has a publish worker upload and sign it and rolls it
   out to two hosts on the stack's engine (vLLM under `make demo`); the router is then asked like a
   user, with the ``openai`` client: the golden prompt and a few greedy completions
   (weightcast/demo_training.py). With ``train_steps=0`` a Llama built here is rolled out instead
   (weightcast/demo_hf.py);
3. publishes a random reference checkpoint of ``size`` bytes the way CI does (`weightcast publish`:
   upload, sign, start the rollout) and shows RolloutWorkflow's progress to every host: manifest →
   distribute (swarm) → verify → staged load (smoke-tested) → traffic steps;
4. sends an inference request through the router and checks the answer against those weights, then
   prints the Temporal UI links.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import aiohttp
import torch
from temporalio.service import RPCError, RPCStatusCode

from peerd.client import PeerdClient, PeerdError
from peerd.origin import OriginSpec
from peerd.signing import generate_keypair
from serving.checkpoint import write_checkpoint
from serving.model import init_model
from serving.model_config import ModelConfig
from weightcast.demo_hf import roll_out_llama
from weightcast.demo_training import PrologueFailed, serve_and_ask, train_then_roll_out
from weightcast.publish import PublishRequest, publish_and_start
from weightcast.rollouts import rollout_id
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from workflows.rollout import RolloutWorkflow


HF_DEADLINE_S = 900          # a vLLM cold start on a small CPU machine takes a minute or two


class DemoFailed(RuntimeError):
    """The rollout did not finish by its deadline; the message says which hosts, where, and why."""


async def run_demo(hosts: int, size: int, rate: float, progress=None, keep_ui_s: float = 0.0, ui: bool = True,
                   step_wait_s: float = 0.5, deadline_s: float | None = None, hold=None, train_steps: int = 0,
                   say=None, engine: str = "transformers", before_publish=None, meter=None) -> dict:
    """``hold(result)``: awaited with the result before the stack is torn down, so the printed Temporal
    UI link and the CLI work against the live stack until it returns (the CLI waits for Enter).
    ``train_steps``: train a Llama that many steps first and roll it out (0: roll out a Llama built here).
    ``engine``: what runs the Hugging Face Llama on the hosts (``transformers`` or ``vllm``).
    ``before_publish(stack, req)``: awaited with the publish request before it runs; what it returns
    goes into the result as ``before_publish`` (`bench rollout` measures the storage there).
    ``meter()``: a reading taken when publishing starts and when the rollout ends; their difference
    is the result's ``metered`` (`bench rollout` passes the stack's CPU seconds)."""
    if hosts < 2 and train_steps:
        raise DemoFailed("the training prologue runs two ranks on two hosts: give --hosts 2 or more, or --train-steps 0")
    work = Path(tempfile.mkdtemp(prefix="wc-demo-"))
    mcfg, seed = ModelConfig.for_size(size), 7
    version = f"v{uuid.uuid4().hex[:6]}"       # a fresh version each run: a second `make demo` works too
    say = say or (lambda line: print(line, file=sys.stderr))
    stack, training = None, None
    try:
        generate_keypair(work / "key.pem", work / "key.pub")
        stack = await EmbeddedStack(work / "stack", work / "key.pub", [f"h{i}" for i in range(hosts)],
                                    rate=rate, ui=ui, engine=engine, preload_training=bool(train_steps)).start()
        hf = None
        if train_steps:
            limit = HF_DEADLINE_S + 10 * train_steps
            try:
                trained = await asyncio.wait_for(train_then_roll_out(
                    stack, work, work / "key.pem", "llama", version, train_steps, stack.hosts[:2],
                    {"router": stack.router_addr, "step_wait_s": step_wait_s}, say), limit)
                hf = await asyncio.wait_for(serve_and_ask(stack, trained, "llama", say), HF_DEADLINE_S)
            except (asyncio.TimeoutError, PrologueFailed) as e:
                raise DemoFailed(json.dumps({"training": str(e) or "not done in time", "dead": _dead_parts(stack)})) from None
            training = trained.report
        src = write_checkpoint(work / "ckpt", mcfg, seed, shard_bytes=16 << 20, version=version)
        req = PublishRequest(src, "demo", version, work / "key.pem",
                             OriginSpec(stack.s3.endpoint, stack.s3.bucket, f"demo/{version}"),
                             chunk_size=1 << 20, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        measured = await before_publish(stack, req) if before_publish else None
        loop = asyncio.get_running_loop()
        m0 = meter() if meter else None
        t0 = loop.time()          # from `publish` (hash + sign + start, then the upload) to every host serving
        publishing = asyncio.ensure_future(publish_and_start(stack.client, req, stack.hosts, router=stack.router_addr,
                                                             step_wait_s=step_wait_s))
        wid = rollout_id("demo", version)
        while not publishing.done() and not await _started(stack, wid):
            await asyncio.wait([publishing], timeout=0.05)
        if publishing.done() and publishing.exception() is not None:
            publishing.result()                  # refused before its rollout started: raised here
        handle = stack.client.get_workflow_handle(wid)
        print(f"rollout {handle.id} started; Temporal UI: {stack.ui_url(handle.id)}", file=sys.stderr)
        result_task = asyncio.ensure_future(handle.result())
        pub = None
        deadline = t0 + (deadline_s or 120 + 10 * size / rate)      # never wait forever on a dead part
        while not result_task.done():
            if pub is None and publishing.done():
                pub = publishing.result()        # the upload has finished (or failed: raised here)
            st = await handle.query(RolloutWorkflow.status)
            if loop.time() > deadline:
                result_task.cancel()
                raise DemoFailed(json.dumps({"deadline_s": round(deadline - t0, 1), "phase": st.phase,
                                             "detail": st.detail, "hosts": st.hosts, "errors": st.errors,
                                             "dead": _dead_parts(stack)}))
            if progress and st.version_id:
                ready = st.counts.get("ready", 0)
                bytes_done = sum(p.get("bytes_done", 0) for p in await _peerd_jobs(stack, st.version_id))
                progress(loop.time() - t0, bytes_done + ready, st.bytes_total + hosts, st.phase)
            await asyncio.wait([result_task], timeout=0.5)
        result = result_task.result()
        elapsed = loop.time() - t0
        metered = meter() - m0 if meter else None
        pub = pub or await publishing
        reference = await asyncio.to_thread(init_model, mcfg, seed)
        jobs = [j for j in await _peerd_jobs(stack, pub["version_id"]) if j.get("finished")]   # answering hosts
        st = await handle.query(RolloutWorkflow.status)
        ids = [[1, 2, 3, 4, 5]]
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{stack.router_addr}/v1/models/demo/infer", json={"input_ids": ids}) as r:
                answer = await r.json()
        with torch.no_grad():
            want = reference(torch.tensor(ids))[:, -1, :16]
        correct = r.status == 200 and bool(torch.allclose(torch.tensor(answer["logits_head"]), want, atol=1e-4))
        if hf is None:
            try:
                hf = await asyncio.wait_for(roll_out_llama(stack, work, work / "key.pem", say), HF_DEADLINE_S)
            except asyncio.TimeoutError:
                raise DemoFailed(json.dumps({"llama": f"not rolled out within {HF_DEADLINE_S} s",
                                             "dead": _dead_parts(stack)})) from None
        if keep_ui_s:
            await asyncio.sleep(keep_ui_s)
        res = {"workflow_id": handle.id, "temporal_ui": stack.ui_url(handle.id), "temporal": stack.temporal_addr,
               "rollout_s": round(elapsed, 2),
                "publish_s": pub["published_s"], "rollout_started_s": pub["rollout_started_s"],
                "phase_seconds": st.phase_seconds, "before_publish": measured, "metered": metered,
                "swarm_s": round(max(j["finished"] for j in jobs) - min(j["started"] for j in jobs), 2),
                "bytes": pub["bytes"], "hosts_ready": result["ready"], "traffic": result["traffic"],
                "inference": {"routed_host": answer.get("routed_host"), "model_version": answer.get("model_version"),
                              "matches_reference_weights": correct},
                "hf": hf, "ok": correct and len(result["ready"]) == hosts and hf["ok"]}
        if training is not None:
            res["training"] = training
            res["ok"] = res["ok"] and len(training["recoveries"]) >= 1
        if hold is not None:
            await hold(res)
        return res
    finally:
        if stack:
            await stack.stop()
        shutil.rmtree(work, ignore_errors=True)


def _dead_parts(stack: EmbeddedStack) -> list[dict]:
    """Stack processes that died on their own: which, how, and their last log lines."""
    return [d for p in [*stack.peerd.values(), *stack.host_workers.values()] if (d := p.death(12)) is not None]


async def _peerd_jobs(stack: EmbeddedStack, vid: str) -> list[dict]:
    out = []
    for p in stack.peerd.values():
        try:
            async with PeerdClient(p.addr, stack.token) as c:
                out.append(await c.job(vid))
        except (PeerdError, aiohttp.ClientError):
            out.append({})
    return out


async def _started(stack: EmbeddedStack, wid: str) -> bool:
    try:
        await stack.client.get_workflow_handle(wid).describe()
        return True
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        return False
