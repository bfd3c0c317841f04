"""The model server's OpenAI endpoints (``/v1/completions``, ``/v1/chat/completions``): the router
forwards a client's request here with the version it chose (``model_version``); the version's engine
turns text into tokens (the checkpoint's own tokenizer and chat template), generates, and the text
comes back whole or as server-sent events, with usage counts.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
from aiohttp import web

from lib.http_input import BadInput, read_json
from serving import openai_protocol as oa
from serving.engine import VersionGone, VersionKey
from serving.http_json import MAX_BODY

UPSTREAM = web.AppKey("openai_upstream", aiohttp.ClientSession)   # to an engine's own OpenAI server


class TextSession:
    """Tokens to text as they come: a piece is released only once it decodes to whole characters
    (byte-level tokenizers split a character over several tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.sent = text[len(self.sent):], text
        return piece


def prompt_ids(tokenizer, req: oa.Request) -> list[int]:
    if req.kind == "chat":
        if not tokenizer.chat_template:
            raise oa.BadRequest(f"{req.model} has no chat template: use /v1/completions")
        return list(tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    return tokenizer(req.prompt).input_ids


def add_routes(app: web.Application, ms) -> None:
    """Register the OpenAI endpoints on the model server ``ms`` (serving.server.ModelServer)."""

    async def handle(request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await read_json(request, MAX_BODY)       # size- and depth-bounded
            req = oa.parse(kind, body, body.get("model_version") if isinstance(body, dict) else None)
        except BadInput as e:
            return web.json_response(oa.error(str(e)), status=e.status)
        except oa.BadRequest as e:
            return web.json_response(oa.error(str(e)), status=400)
        if req.version is None:
            return web.json_response(oa.error("model_version is required here (the router chooses it)"), status=400)
        key = VersionKey(req.model, req.version)
        vs = ms.versions.get(key)
        if vs is None or vs.state != "ready":
            return web.json_response(oa.error(f"{key.model} {key.version} is not ready on {ms.host_id}",
                                              "not_ready"), status=409 if vs else 404)
        engine = ms.engine
        headers = {"X-Model": key.model, "X-Model-Version": key.version}
        try:
            server = engine.acquire(key)
        except VersionGone:
            return web.json_response(oa.error(f"{key.model} {key.version} was unloaded meanwhile", "not_ready"),
                                     status=409)
        if server is not None:                    # the version runs in its own server (vLLM): ask it
            try:
                return await _proxy(request, app[UPSTREAM], server.base, req, kind, headers, ms, key)
            finally:
                engine.release(server)
        try:
            tokenizer = engine.tokenizer(key)
            ids = prompt_ids(tokenizer, req)
            if not ids or max(ids) >= engine.vocab(key):
                raise oa.BadRequest(f"the prompt's token ids must be in [0, {engine.vocab(key)})")
            if len(ids) + req.max_tokens > engine.context(key):
                raise oa.BadRequest(f"the prompt ({len(ids)} tokens) and max_tokens ({req.max_tokens}) exceed "
                                    f"{key.model}'s context of {engine.context(key)} tokens")
        except VersionGone:
            return web.json_response(oa.error(f"{key.model} {key.version} was unloaded meanwhile", "not_ready"),
                                     status=409)
        except NotImplementedError as e:
            return web.json_response(oa.error(str(e)), status=400)
        except oa.BadRequest as e:
            return web.json_response(oa.error(str(e)), status=400)
        tokens = engine.stream(key, ids, req.max_tokens, req.temperature, req.top_p, req.seed)
        rid = oa.new_id(kind)
        if req.stream:
            return await _stream(request, req, rid, tokenizer, tokens, len(ids), headers, ms, key)
        text = TextSession(tokenizer)
        out: list[str] = []
        n, finish = 0, "length"
        try:
            for tok in await asyncio.to_thread(list, tokens):
                out.append(text.push(tok))
                n += 1
        except VersionGone:
            return web.json_response(oa.error(f"{key.model} {key.version} was unloaded meanwhile", "not_ready"),
                                     status=409)
        if n < req.max_tokens:
            finish = "stop"
        out.append(text.flush())
        ms.m_requests.labels(*key, "ok").inc()
        return web.json_response(oa.answer(req, rid, "".join(out), finish, len(ids), n), headers=headers)

    async def completions(request):
        return await handle(request, "completion")

    async def chat(request):
        return await handle(request, "chat")

    async def session(app):
        app[UPSTREAM] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2,
                                                                                  sock_read=300))
        yield
        await app[UPSTREAM].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)


async def _proxy(request, http, base: str, req: oa.Request, kind: str, headers: dict, ms,
                 key: VersionKey) -> web.StreamResponse:
    """The request to the version's own OpenAI server, its answer back as it comes (a stream byte for byte)."""
    body = {k: v for k, v in req.for_host(key.version).items() if k not in ("model_version", "stream_options")}
    if req.stream:
        body["stream_options"] = {"include_usage": req.include_usage}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        async with http.post(base + path, json=body) as up:
            if up.status != 200 or not req.stream:
                answer = await up.json(content_type=None)
                if up.status == 200:
                    ms.m_requests.labels(*key, "ok").inc()
                return web.json_response(answer, status=up.status if up.status < 500 else 502,
                                         headers=headers if up.status == 200 else None)
            out = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                              "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for data in up.content.iter_any():
                await out.write(data)
            await out.write_eof()
            ms.m_requests.labels(*key, "ok").inc()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return web.json_response(oa.error(f"the engine serving {key.model} {key.version} did not answer: "
                                          f"{type(e).__name__}", "engine_unavailable"), status=502)


async def _stream(request, req: oa.Request, rid: str, tokenizer, tokens: Iterator[int], prompt_tokens: int,
                  headers: dict, ms, key: VersionKey) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    text = TextSession(tokenizer)
    if req.kind == "chat":
        await resp.write(oa.sse(oa.chunk(req, rid, None, None, first=True)))
    n, done = 0, object()
    while True:
        try:
            tok = await asyncio.to_thread(next, tokens, done)
        except VersionGone:            # unloaded mid-answer: end the choice; the client sees it cut short
            break
        if tok is done:
            break
        n += 1
        piece = text.push(tok)
        if piece:
            await resp.write(oa.sse(oa.chunk(req, rid, piece, None)))
    tail = text.flush()
    if tail:
        await resp.write(oa.sse(oa.chunk(req, rid, tail, None)))
    await resp.write(oa.sse(oa.chunk(req, rid, None, "length" if n >= req.max_tokens else "stop")))
    if req.include_usage:
        await resp.write(oa.sse(oa.usage_chunk(req, rid, prompt_tokens, n)))
    await resp.write(oa.sse(None))
    ms.m_requests.labels(*key, "ok").inc()
    await resp.write_eof()
    return resp
