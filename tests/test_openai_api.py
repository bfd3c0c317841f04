"""The router's OpenAI API through the official `openai` client, against the real router in front of
model servers running a Hugging Face Llama on the transformers engine (over loopback HTTP): completions
and chat, streamed and not, usage counts, pinned versions, API keys; answers equal the golden
completions recorded at publish. And the router's two defences, against hosts that lie about their
version or fail: such an answer never reaches a client, and the host leaves the pool."""
import aiohttp
import openai
import pytest
from aiohttp import web

from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.serving_fixtures import store_root, store_version
from weightcast.stack.embedded import serve_app

KEY, ADMIN = "sk-test-key", "admin-secret"


@pytest.fixture
async def served(tmp_path, keys, hf_checkpoints):
    """Two hosts holding llama v1 (ready: golden prompts reproduced), a router with an API key."""
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v1", keys["private"], serving={"golden": golden})
    runners, addrs = [], {}
    for h in ("a", "b"):
        ms = ModelServer(h, store_root=store_root(tmp_path), admin_token=ADMIN)
        assert (await ms.load(("llama", "v1"), d)).state == "ready"
        r, addrs[h] = await serve_app(server_app(ms))
        runners.append(r)
    router = Router(poll_interval=0.1, admin_token=ADMIN, api_keys=frozenset({KEY}), check_timeout_s=10)
    r, raddr = await serve_app(router_app(router))
    runners.append(r)
    for h, a in addrs.items():
        router.table.add_host("llama", h, a)
    router.table.add_version("llama", "v1")
    await router.poll_once()
    router.table.set_weights("llama", {"v1": 100})
    client = openai.AsyncOpenAI(base_url=f"{raddr}/v1", api_key=KEY, max_retries=0)
    yield router, raddr, client, golden, src
    await client.close()
    for r in runners:
        await r.cleanup()


def golden_text(src, p) -> tuple[str, int]:
    """The text of a golden completion up to end-of-text, and its token count."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    ids = p["output_ids"][:p["output_ids"].index(tok.eos_token_id)] if tok.eos_token_id in p["output_ids"] \
        else p["output_ids"]
    return tok.decode(ids, skip_special_tokens=True), len(ids)


async def test_completions_streamed_and_not_reproduce_the_golden_completions(served):
    router, _, client, golden, src = served
    assert {"llama", "llama@v1"} <= {m.id async for m in client.models.list()}
    for p in golden["prompts"]:
        want, n = golden_text(src, p)
        r = await client.completions.create(model="llama", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                            temperature=0)
        assert r.choices[0].text == want and r.model == "llama"
        assert r.usage.prompt_tokens == len(p["input_ids"]) and r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == ("length" if n == len(p["output_ids"]) else "stop")
        pieces, finish, usage = [], None, None
        stream = await client.completions.create(model="llama@v1", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert "".join(pieces) == want and finish == r.choices[0].finish_reason
        assert usage.completion_tokens == n and usage.total_tokens == n + len(p["input_ids"])
    # the same prompt as token ids
    p = golden["prompts"][0]
    r = await client.completions.create(model="llama", prompt=p["input_ids"], max_tokens=len(p["output_ids"]),
                                        temperature=0)
    assert r.choices[0].text == golden_text(src, p)[0]
    # sampling: reproducible with a seed
    a, b = [await client.completions.create(model="llama", prompt="The value of", max_tokens=12, temperature=1.0,
                                            top_p=0.9, seed=7) for _ in range(2)]
    assert a.choices[0].text == b.choices[0].text


async def test_chat_uses_the_checkpoints_template_streamed_and_not(served):
    _, _, client, _, _ = served
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a list?"}]
    r = await client.chat.completions.create(model="llama", messages=msgs, max_tokens=10, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text and r.usage.completion_tokens >= 1
    pieces = []
    async for chunk in await client.chat.completions.create(model="llama", messages=msgs, max_tokens=10,
                                                            temperature=0, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces) == text


async def test_clients_get_openai_errors_for_bad_requests(served):
    _, raddr, client, _, _ = served
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="llama@v9", prompt="x", max_tokens=2)   # no such version
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.completions.create(model="llama", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        await client.completions.create(model="llama", prompt="x " * 200, max_tokens=200)
    for key in ("wrong", ADMIN):                            # the admin token is not an API key
        bad = openai.AsyncOpenAI(base_url=f"{raddr}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model="llama", prompt="x", max_tokens=2)
        await bad.close()
    async with aiohttp.ClientSession() as s:               # not JSON at all: a 400, never a 500
        async with s.post(f"{raddr}/v1/chat/completions", data=b"{", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 400 and "error" in await r.json()


def impostor(version_header: str | None, status: int = 200) -> web.Application:
    """A host that says it is ready for anything, then answers as another version (or fails)."""
    async def ready(_):
        return web.json_response({"ready": True})

    async def answer(_):
        headers = {"X-Model": "llama", "X-Model-Version": version_header} if version_header else {}
        body = {"id": "x", "object": "text_completion", "model": "llama", "created": 0,
                "choices": [{"index": 0, "text": "FROM THE IMPOSTOR", "finish_reason": "stop", "logprobs": None}],
                "model_version": version_header, "next_token": [0], "logits_head": [[0.0]]}
        return web.json_response(body, status=status, headers=headers)
    app = web.Application()
    app.router.add_get("/health/ready", ready)
    for path in ("/v1/completions", "/v1/infer"):
        app.router.add_post(path, answer)
    return app


@pytest.mark.parametrize("liar", ["answers as another version", "fails"])
async def test_a_lying_or_failing_host_never_answers_a_client_and_leaves_the_pool(served, liar):
    router, raddr, client, _, _ = served
    runner, addr = await serve_app(impostor("v0") if liar == "answers as another version" else impostor(None, 500))
    try:
        router.table.add_host("llama", "x", addr)
        await router.poll_once()
        assert "x" in router.table.models["llama"].ready_hosts("v1")     # it claims readiness
        before = router.m_evictions._value.get()
        seen = set()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            # routing is random: go on until x has been tried, dropped, readmitted and tried again
            for _ in range(100):
                r = await client.completions.with_raw_response.create(model="llama", prompt="The value of",
                                                                      max_tokens=3, temperature=0)
                assert r.headers["X-Model-Version"] == "v1" and "IMPOSTOR" not in r.parse().choices[0].text
                seen.add(r.headers["X-Routed-Host"])
                async with s.post(f"{raddr}/v1/models/llama/infer", json={"input_ids": [[1, 2]]}) as legacy:
                    body = await legacy.json()
                    assert legacy.status == 200 and body["routed_host"] != "x" and body["model_version"] == "v1"
                if router.m_evictions._value.get() >= before + 2:
                    break
                await router.poll_once()                  # the poller readmits it: it is tried again, and fails again
        assert "x" not in seen and router.m_evictions._value.get() >= before + 2
    finally:
        router.table.remove_host("llama", "x")
        await runner.cleanup()
