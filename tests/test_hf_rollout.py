"""A Hugging Face directory of each architecture (Llama, Qwen2, GPT-2) through `weightcast publish`
(golden prompts recorded into the signed manifest), the rollout workflow on the dev server, peerd and
the transformers engine on every host, to the official openai client's answers through the router:
the golden completions. A checkpoint too undecided to
record golden prompts from is refused before anything is uploaded."""
import json

import aiohttp
import pytest

from peerd.origin import OriginSpec
from serving import hf_build
from tests.serving_fixtures import publish_hf
from weightcast.publish import PublishError, PublishRequest, upload
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY

HOSTS = ["a", "b"]


async def test_each_architecture_publishes_rolls_out_and_answers(tmp_path, seaweed, keys, hf_checkpoints, temporal):
    import openai

    from tests.test_openai_api import golden_text
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], HOSTS, s3=seaweed,
                                **temporal.stack_args()).start()
    client = openai.AsyncOpenAI(base_url=f"{stack.router_addr}/v1", api_key="none", max_retries=0)
    try:
        for arch, (src, golden) in hf_checkpoints.items():
            result = await publish_hf(stack, seaweed, keys, src, arch, "v1")
            assert result["ready"] == HOSTS and result["traffic"] == {"v1": 100}, result
            # the golden prompts travelled in the signed manifest, and every host reproduced them to be ready
            stored = json.loads((stack.peerd["a"].store / "versions" / result["version_id"] / "manifest.json")
                                .read_bytes())
            assert stored["manifest"]["serving"]["golden"]["prompts"]
            async with aiohttp.ClientSession() as http:
                for h in stack.hosts:
                    async with http.get(f"{h.model_server}/v1/versions") as r:
                        held = {(v["model"], v["version"]): v for v in (await r.json())["versions"]}
                    assert held[(arch, "v1")]["state"] == "ready"
                async with http.post(f"{stack.router_addr}/v1/models/{arch}/infer",
                                     json={"input_ids": [[1, 2, 3]]}) as r:
                    body = await r.json()
                assert r.status == 200 and body["model"] == arch and body["model_version"] == "v1"
            for p in golden["prompts"][:2]:          # the official client gets the golden completions
                answer = await client.completions.create(model=arch, prompt=p["text"],
                                                         max_tokens=len(p["output_ids"]), temperature=0)
                assert answer.choices[0].text == golden_text(src, p)[0], arch
    finally:
        await client.close()
        await stack.stop()


async def test_a_checkpoint_too_undecided_for_golden_prompts_is_refused_before_upload(tmp_path, seaweed, keys):
    """Every weight zero: every logit ties, no greedy token is evidence of anything."""
    import torch
    from transformers import AutoModelForCausalLM
    src = hf_build.build("llama", tmp_path / "flat", train_steps=0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.save_pretrained(src, max_shard_size="100KB")
    req = PublishRequest(src, "undecided", "v1", keys["priv_path"],
                         OriginSpec(seaweed.endpoint, seaweed.bucket, "hf/undecided/v1"),
                         access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    with pytest.raises(PublishError, match="top-1 margin.*nothing published"):
        await upload(req)
