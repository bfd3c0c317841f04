"""The demo's Hugging Face part: a small Llama directory (built and trained here, bf16, sharded, with
its tokenizer and chat template) published the way CI does (golden prompts recorded into the signed
manifest), rolled out through RolloutWorkflow to two hosts whose model servers run it on the stack's
engine (vLLM under `make demo`), and asked for a completion through the router's OpenAI API with the
official ``openai`` client. The answer must be the golden completion recorded at publish."""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import openai

from peerd.origin import OriginSpec
from serving import golden, hf_build
from weightcast.publish import PublishRequest, publish_and_start
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY

MODEL = "llama"


async def roll_out_llama(stack: EmbeddedStack, work: Path, key: Path, say, step_wait_s: float = 0.0) -> dict:
    version = f"v{uuid.uuid4().hex[:6]}"
    say(f"building a Llama (Hugging Face directory, bf16) and rolling {MODEL} {version} out on the "
        f"{stack.engine} engine")
    src = await asyncio.to_thread(hf_build.build, "llama", work / "llama")
    record = await asyncio.to_thread(golden.record, src)
    req = PublishRequest(src, MODEL, version, key, OriginSpec(stack.s3.endpoint, stack.s3.bucket, f"{MODEL}/{version}"),
                         chunk_size=256 << 10, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    t0 = time.monotonic()
    hosts = stack.hosts[:2]
    started = await publish_and_start(stack.client, req, hosts, router=stack.router_addr,
                                      step_wait_s=step_wait_s)
    result = await stack.client.get_workflow_handle(started["workflow_id"]).result()
    rollout_s = time.monotonic() - t0
    answer = await ask_like_a_user(stack, src, record, MODEL)
    return {"model": MODEL, "version": version, "engine": stack.engine, "workflow_id": started["workflow_id"],
            "hosts_ready": result["ready"], "rollout_s": round(rollout_s, 1), **answer,
            "ok": answer["openai_completion"]["matches_golden"] and len(result["ready"]) == len(hosts)}


async def ask_like_a_user(stack: EmbeddedStack, src: Path, record: dict, model: str,
                          greedy_prompts: tuple[str, ...] = ()) -> dict:
    """The first golden prompt through the router's OpenAI API with the official client, compared with
    the completion recorded at publish (decoded with the checkpoint's own tokenizer); and greedy
    completions of ``greedy_prompts``, to show what the model has learnt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    prompt = record["prompts"][0]
    ids = prompt["output_ids"]
    eos = tok.eos_token_id
    want = tok.decode(ids[:ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)
    client = openai.AsyncOpenAI(base_url=f"{stack.router_addr}/v1", api_key="none", max_retries=0)
    try:
        answer = await client.completions.create(model=model, prompt=prompt["text"], max_tokens=len(ids),
                                                 temperature=0)
        greedy = [{"prompt": p, "text": (await client.completions.create(
            model=model, prompt=p, max_tokens=40, temperature=0)).choices[0].text} for p in greedy_prompts]
    finally:
        await client.close()
    text = answer.choices[0].text
    return {"openai_completion": {"prompt": prompt["text"], "text": text, "matches_golden": text == want},
            **({"greedy": greedy} if greedy_prompts else {})}
