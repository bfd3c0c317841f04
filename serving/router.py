"""The readiness-gated inference router (aiohttp) around ``RoutingTable``.

The admin API (``/admin/...``) needs the admin token (``Authorization: Bearer``); inference and
metrics are open. Readiness is polled continuously (``GET /health/ready?model=M&model_version=V`` on every host
for every known version of every model); a failed forward or a host that answers "not ready" leaves the pool at once and the request
is retried on another host ready for the *same* version. The answer's ``X-Model-Version`` must match
the version routed to (and ``X-Model`` the model), or it is discarded.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from lib.secret_input import ADMIN_TOKEN, add_secret_file_arg, read_secret
from lib.conn_guard import run_guarded
from lib.http_input import bearer_ok
from lib.metrics_http import metrics_handler
from serving import openai_protocol as oa, router_openai
from serving.capacity import CapacityRules
from serving.http_json import MAX_BODY, bad_request, json_object
from serving.routing import ModelRoute, RoutingError, RoutingTable
from serving.version_stats import VersionStats

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}\Z")
_ADDR = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]{1,256}/?\Z")

log = logging.getLogger("serving.router")


class Router:
    def __init__(self, poll_interval: float = 0.2, retries: int = 3, rules: CapacityRules | None = None,
                 seed: int | None = None, admin_token: str = "", api_keys: frozenset[str] = frozenset(),
                 check_timeout_s: float = 1.0):
        self.table = RoutingTable(seed)
        self.check_timeout_s = check_timeout_s  # a host that takes longer to say it is ready is out of the pool
        self.admin_token = admin_token          # empty disables admin auth (in-process tests only)
        self.api_keys = frozenset(api_keys)     # clients' keys for /v1/*; none: inference is open
        self.poll_interval = poll_interval
        self.retries = retries
        self.rules = rules or CapacityRules()
        self.loading: dict[str, set[str]] = {}       # model -> hosts holding a load permit
        self.http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("router_requests_total", "Routed requests", ["model", "version", "outcome"], registry=r)
        self.m_evictions = Counter("router_evictions_total", "Hosts dropped from a pool on a failed forward", registry=r)
        self.m_latency = Histogram("router_request_seconds", "Latency of each forwarded attempt, by version",
                                   ["model", "version", "ok"], registry=r)
        self.m_ttft = Histogram("router_time_to_first_token_seconds", "Streamed answers: request to first byte",
                                ["model", "version"], registry=r)
        self.stats = VersionStats()             # the same outcomes, windowed, for canary analysis

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, sock_connect=1))
        self._poller = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        if self.http:
            await self.http.close()

    async def _check(self, model: str, host: str, addr: str, version: str) -> None:
        try:
            async with self.http.get(f"{addr}/health/ready", params={"model": model, "model_version": version},
                                     timeout=aiohttp.ClientTimeout(total=self.check_timeout_s)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if model in self.table.models and host in self.table.models[model].hosts:
            self.table.set_ready(model, host, version, ok)

    async def poll_once(self) -> None:
        checks = [self._check(m, h, a, v) for m, r in self.table.models.items()
                  for h, a in list(r.hosts.items()) for v in list(r.weights)]
        await asyncio.gather(*checks)

    async def _poll_loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval)

    def _observe(self, model: str, version: str, ok: bool, t0: float) -> None:
        seconds = time.monotonic() - t0
        self.m_latency.labels(model, version, "true" if ok else "false").observe(seconds)
        self.stats.record(model, version, ok, seconds)

    def answered(self, model: str, version: str, t0: float) -> None:
        self.m_requests.labels(model, version, "ok").inc()
        self._observe(model, version, True, t0)

    def failed_attempt(self, model: str, host: str, version: str, t0: float) -> None:
        """A host failed, timed out or answered for another version: out of the pool at once (the poller
        may readmit it), and the attempt counts against the version it tried."""
        self._observe(model, version, False, t0)
        self.table.set_ready(model, host, version, False)
        self.m_evictions.inc()

    async def forward(self, model: str, version: str | None, payload: dict) -> tuple[int, dict]:
        tried: set[str] = set()
        last = "no attempt"
        for _ in range(self.retries):
            try:
                host, addr, v = self.table.route(model, version, exclude=tried)
            except RoutingError as e:
                if tried:
                    break
                self.m_requests.labels(model, version or "", "refused").inc()
                return e.status, {"error": str(e)}
            tried.add(host)
            t0 = time.monotonic()
            try:
                async with self.http.post(f"{addr}/v1/infer", json={**payload, "model": model, "model_version": v}) as r:
                    body = await r.json(content_type=None)
                    if (r.status == 200 and r.headers.get("X-Model-Version") == v and body.get("model_version") == v
                            and r.headers.get("X-Model") == model and body.get("model") == model):
                        self.answered(model, v, t0)
                        return 200, {**body, "routed_host": host}
                    if r.status in (400, 413, 422):   # the client's request was bad: the host is fine
                        self.m_requests.labels(model, v, "bad_request").inc()
                        return r.status, body
                    last = f"{host} answered {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                last = f"{host}: {type(e).__name__}"
            self.failed_attempt(model, host, v, t0)
        self.m_requests.labels(model, version or "", "failed").inc()
        return 503, {"error": f"no ready host answered ({last})"}


def make_app(router: Router) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path.startswith("/admin/") and router.admin_token and not bearer_ok(request, router.admin_token):
            return web.json_response({"error": "the admin API needs the admin token (Authorization: Bearer <token>)"},
                                     status=401)
        if (request.path.startswith("/v1/") and router.api_keys
                and not any(bearer_ok(request, k) for k in router.api_keys)):
            return web.json_response(oa.error("a valid API key is needed (Authorization: Bearer <key>)",
                                              "invalid_request_error", "invalid_api_key"), status=401)
        return await handler(request)

    app = web.Application(client_max_size=MAX_BODY, middlewares=[auth])
    t = router.table

    def model_host(request, host) -> str:
        """A host registered for this model (permits for unknown or null hosts would leak capacity)."""
        model = request.match_info["model"]
        if not isinstance(host, str) or host not in t.models.get(model, ModelRoute()).hosts:
            raise bad_request(f"host {host!r} is not registered for model {model!r}; PUT its address first")
        return host

    async def body(request) -> dict:
        return await json_object(request)

    def err(e: RoutingError) -> web.Response:
        return web.json_response({"error": str(e)}, status=e.status)

    async def infer(request):
        model = request.match_info["model"]
        b = await body(request)
        version = b.pop("model_version", None)
        b.pop("model", None)                    # the path names the model
        if version is not None and (not isinstance(version, str) or not _HOST.match(version)):
            raise bad_request(f"model_version {version!r} must be a version name (or absent)")
        status, out = await router.forward(model, version, b)
        headers = {"X-Model": model, "X-Model-Version": out["model_version"]} if status == 200 else None
        return web.json_response(out, status=status, headers=headers)

    async def put_hosts(request):
        model = request.match_info["model"]
        b = await body(request)
        for host, addr in b.items():
            if not isinstance(addr, str) or not _ADDR.match(addr) or not _HOST.match(host):
                return web.json_response({"error": f"host {host!r}: id must be a plain name and the address "
                                                   "http(s)://host:port"}, status=400)
        if not b:
            raise bad_request("give at least one host: {\"<host id>\": \"http://addr:port\"}")
        for host, addr in b.items():
            t.add_host(model, host, addr)
        return web.json_response({"hosts": t.models[model].hosts})

    async def delete_host(request):
        try:
            t.remove_host(request.match_info["model"], request.match_info["host"])
        except RoutingError as e:
            return err(e)
        return web.json_response({"removed": request.match_info["host"]})

    async def add_version(request):
        b = await body(request)
        v = b.get("version")
        if not isinstance(v, str) or not _HOST.match(v):
            return web.json_response({"error": f"version {v!r} must be a plain name (letters, digits, . _ -)"},
                                     status=400)
        t.add_version(request.match_info["model"], v)
        await router.poll_once()
        return web.json_response({"versions": t.models[request.match_info["model"]].weights})

    async def put_weights(request):
        model = request.match_info["model"]
        b = await body(request)
        await router.poll_once()      # decide on fresh readiness, not a cached one
        try:
            t.set_weights(model, b.get("weights") if isinstance(b.get("weights"), dict) else {})
        except RoutingError as e:
            return err(e)
        return web.json_response({"weights": t.models[model].weights})

    async def stats(request):
        """Per-version requests, error rate and latency over the last ``since_s`` seconds (max 600)."""
        raw = request.query.get("since_s", "60")
        try:
            since = float(raw)
        except ValueError:
            since = float("nan")
        if not 0 < since <= 600:
            raise bad_request(f"since_s must be a number of seconds in (0, 600], got {raw[:32]!r}")
        return web.json_response({"since_s": since, "versions": router.stats.summary(request.match_info["model"], since)})

    async def show(request):
        try:
            r = t.model(request.match_info["model"])
        except RoutingError as e:
            return err(e)
        return web.json_response({"hosts": r.hosts, "weights": r.weights,
                                  "ready": {v: r.ready_hosts(v) for v in r.weights},
                                  "loading": sorted(router.loading.get(request.match_info["model"], ()))})

    async def load_permit(request):
        model = request.match_info["model"]
        b = await body(request)
        host = model_host(request, b.get("host"))
        held = router.loading.setdefault(model, set())
        if host in held:
            return web.json_response({"granted": True})
        ok, why = router.rules.may_load(len(held))
        if not ok:
            return web.json_response({"granted": False, "reason": why}, status=409)
        held.add(host)
        return web.json_response({"granted": True})

    async def release_load(request):
        router.loading.get(request.match_info["model"], set()).discard(request.match_info["host"])
        return web.json_response({"released": True})

    async def unload_permit(request):
        model = request.match_info["model"]
        b = await body(request)
        try:
            r = t.model(model)
        except RoutingError as e:
            return err(e)
        v, host = b.get("version"), b.get("host")
        if not isinstance(v, str) or not _HOST.match(v) or not isinstance(host, str) or not _HOST.match(host):
            raise bad_request("unload permits need host and version names")
        if host not in r.hosts:
            return web.json_response({"granted": True, "reason": f"{host} is not routed for {model}"})
        await router.poll_once()
        ok, why = router.rules.may_unload(len(r.ready_hosts(v)), r.weights.get(v, 0.0))
        if not ok:
            return web.json_response({"granted": False, "reason": why}, status=409)
        t.set_ready(model, host, v, False)    # drained before it is unloaded
        return web.json_response({"granted": True})

    app.router.add_post("/v1/models/{model}/infer", infer)
    app.router.add_put("/admin/models/{model}/hosts", put_hosts)
    app.router.add_delete("/admin/models/{model}/hosts/{host}", delete_host)
    app.router.add_post("/admin/models/{model}/versions", add_version)
    app.router.add_put("/admin/models/{model}/weights", put_weights)
    app.router.add_get("/admin/models/{model}", show)
    app.router.add_get("/admin/models/{model}/stats", stats)
    app.router.add_post("/admin/models/{model}/permits/load", load_permit)
    app.router.add_delete("/admin/models/{model}/permits/load/{host}", release_load)
    app.router.add_post("/admin/models/{model}/permits/unload", unload_permit)
    app.router.add_get("/metrics", metrics_handler(router.registry))
    router_openai.add_routes(app, router)

    async def on_startup(_):
        await router.start()

    async def on_cleanup(_):
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="router")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--listen", default="127.0.0.1")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send a request head (default 10)")
    ap.add_argument("--body-timeout", type=float, default=60.0,
                    help="seconds a request's body may take to arrive after its head (default 60)")
    ap.add_argument("--ready-file", type=Path, help="write {addr} JSON here once listening")
    ap.add_argument("--max-concurrent-loads", type=int, default=2)
    ap.add_argument("--old-floor", type=int, default=1)
    add_secret_file_arg(ap, ADMIN_TOKEN, "admin token (load/unload, the admin API); required")
    ap.add_argument("--api-keys-file", type=Path,
                    help="clients' API keys, one per line, for /v1/* (Authorization: Bearer); without it inference "
                         "is open. Separate from the admin token, which does not grant inference")
    return ap


def main(argv=None) -> int:
    from lib.logging_setup import setup
    a = build_parser().parse_args(argv)
    setup()
    admin_token = read_secret(a, ADMIN_TOKEN)
    if not admin_token:
        print('{"level": "ERROR", "msg": "no admin token: set WEIGHTCAST_ADMIN_TOKEN (from a secret) or --admin-token-file"}',
              file=sys.stderr)
        return 2
    keys = frozenset(ln.strip() for ln in a.api_keys_file.read_text().splitlines() if ln.strip()) \
        if a.api_keys_file else frozenset()
    run_guarded(make_app(Router(rules=CapacityRules(a.max_concurrent_loads, a.old_floor), admin_token=admin_token,
                                api_keys=keys)),
                a.listen, a.port, header_timeout=a.header_timeout,
                body_timeout=a.body_timeout, ready_file=a.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
