"""The router's OpenAI API: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` as server-sent events ending in ``data: [DONE]``).

A request names ``<model>`` (split over the versions by the rollout's weights) or pins ``<model>@<version>``
(or sends ``X-Weightcast-Version``). The router picks a host ready for that version, forwards the
request to the host's model server with the version resolved, and answers only with what that host
says for that version: an answer whose ``X-Model``/``X-Model-Version`` differ from what was routed is
discarded, the host leaves the pool and the request goes to another host ready for the same version
(so does a host that fails or times out). A stream is committed to its host at its first byte.

Clients authenticate with ``Authorization: Bearer <api key>`` when the router has API keys (separate
from the admin token, which does not grant inference).
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from lib.http_input import BadInput, read_json
from serving import openai_protocol as oa
from serving.http_json import MAX_BODY
from serving.routing import RoutingError, UnknownVersion

STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=1, sock_read=120)


def _error(message: str, status: int, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response(oa.error(message, kind, code), status=status)


def add_routes(app: web.Application, router) -> None:
    """Register the OpenAI endpoints of ``router`` (serving.router.Router) on ``app``."""

    async def models(_request):
        """Every model with a weighted version some host is ready for, and each ready version pinned."""
        data = []
        for name, route in sorted(router.table.models.items()):
            ready = [v for v in sorted(route.weights) if route.ready_hosts(v)]
            if any(route.weights[v] > 0 for v in ready):
                data.append({"id": name, "object": "model", "created": 0, "owned_by": "weightcast"})
            data += [{"id": f"{name}@{v}", "object": "model", "created": 0, "owned_by": "weightcast"} for v in ready]
        return web.json_response({"object": "list", "data": data})

    async def completions(request):
        return await forward(request, "completion")

    async def chat(request):
        return await forward(request, "chat")

    async def forward(request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await read_json(request, MAX_BODY)       # size- and depth-bounded
            req = oa.parse(kind, body, request.headers.get("X-Weightcast-Version"))
        except BadInput as e:
            return _error(str(e), e.status)
        except oa.BadRequest as e:
            return _error(str(e), 400)
        if req.model not in router.table.models:
            return _error(f"the model {req.model!r} does not exist here (GET /v1/models)", 404, code="model_not_found")
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        tried: set[str] = set()
        last = "no attempt"
        for _ in range(router.retries):
            try:
                host, addr, version = router.table.route(req.model, req.version, exclude=tried)
            except RoutingError as e:
                if tried:
                    break
                router.m_requests.labels(req.model, req.version or "", "refused").inc()
                return _error(str(e), e.status, "not_found_error" if isinstance(e, UnknownVersion)
                              else "service_unavailable")
            tried.add(host)
            t0 = time.monotonic()
            try:
                upstream = await router.http.post(addr + path, json=req.for_host(version), timeout=STREAM_TIMEOUT)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{host}: {type(e).__name__}"
                router.failed_attempt(req.model, host, version, t0)
                continue
            async with upstream:
                honest = (upstream.headers.get("X-Model") == req.model
                          and upstream.headers.get("X-Model-Version") == version)
                if upstream.status == 200 and honest:
                    headers = {"X-Model": req.model, "X-Model-Version": version, "X-Routed-Host": host}
                    if not req.stream:
                        answer = await upstream.json(content_type=None)
                        router.answered(req.model, version, t0)
                        return web.json_response(answer, headers=headers)
                    return await _pipe(request, upstream, headers, router, req.model, version, t0)
                if upstream.status in (400, 413, 422):          # the client's request was bad: the host is fine
                    router.m_requests.labels(req.model, version, "bad_request").inc()
                    return web.json_response(await upstream.json(content_type=None), status=upstream.status)
                last = (f"{host} answered {upstream.status}" if upstream.status != 200 else
                        f"{host} answered as {upstream.headers.get('X-Model')} {upstream.headers.get('X-Model-Version')}, "
                        f"not {req.model} {version}: discarded")
            router.failed_attempt(req.model, host, version, t0)
        router.m_requests.labels(req.model, req.version or "", "failed").inc()
        return _error(f"no ready host answered ({last})", 503, "service_unavailable")

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)


async def _pipe(request, upstream, headers: dict, router, model: str, version: str, t0: float) -> web.StreamResponse:
    """The host's event stream, byte for byte, to the client; time to first token observed."""
    out = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    first = True
    async for data in upstream.content.iter_any():
        if first:
            router.m_ttft.labels(model, version).observe(time.monotonic() - t0)
            first = False
        await out.write(data)
    await out.write_eof()
    router.answered(model, version, t0)
    return out
