"""The per-host model server: loads verified versions, smoke-tests them, answers readiness per version.

A version is a (model, version) pair: one host serves several models, and the same label in two
models names two different checkpoints. ``GET /health/ready?model=M&model_version=V`` is 200 only
when M's version V is verified, loaded and passed its smoke test on this host: fail closed (no
model, no ready). Inference answers carry ``X-Model`` and ``X-Model-Version``.
Load and unload need the admin token (``Authorization: Bearer``) and load only
``<store>/versions/<version id>/model`` under the peerd store it is configured with; health, versions,
metrics and inference are open (read-only or the product itself).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from lib.secret_input import ADMIN_TOKEN, add_secret_file_arg, read_secret
from lib.conn_guard import run_guarded
from lib.http_input import bearer_ok
from lib.metrics_http import metrics_handler
from peerd.signing import load_public_key
from serving import openai_host
from serving.auto_engine import AutoEngine
from serving.engine import Engine, VersionGone, VersionKey
from serving.footprint import KV_CACHE_TOKENS
from serving.hf_engine import TransformersEngine
from serving.http_json import MAX_BODY, bad_request, json_object
from serving.loader import LoadError
from serving.prepare import Preparer
from serving.trust import ManifestTrust
from serving.verified_read import VerifyError

log = logging.getLogger("serving.model_server")
_VID = re.compile(r"^[0-9a-f]{64}\Z")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}\Z")


@dataclass
class VersionState:
    state: str = "loading"          # loading | ready | failed
    reason: str = ""
    code: str = ""
    nbytes: int = 0
    path: str = ""
    read_ahead_bytes: int = 0       # of the load's bytes, those read and verified while distribution finished


@dataclass
class ModelServer:
    host_id: str
    engine: Engine = field(default_factory=AutoEngine)
    max_versions: int = 2
    memory_budget: int | None = None
    store_root: Path | None = None     # peerd's store: the only place versions are loaded from
    admin_token: str = ""              # required for load/unload; empty disables auth (in-process tests only)
    trust: ManifestTrust = field(default_factory=ManifestTrust)    # whose signed versions it loads
    versions: dict[VersionKey, VersionState] = field(default_factory=dict)
    # fault injection for drills and tests (a version that passes its smoke test but serves badly):
    # {(model, version): {"delay_s": extra latency per request, "error_every": every Nth request answers
    #                     500, "load_delay_s": extra time before a load starts, "load_gate": an
    #                     asyncio.Event a load waits for before it starts (in-process drills)}}
    faults: dict[VersionKey, dict] = field(default_factory=dict)
    read_ahead_bytes: int | None = None   # memory for files read ahead of a load (None: a quarter of RAM)

    def __post_init__(self):
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("model_server_requests_total", "Inference requests", ["model", "version", "outcome"],
                                  registry=r)
        self.m_ready = Gauge("model_server_version_ready", "1 when a version is ready here", ["model", "version"],
                             registry=r)
        self.m_loads = Counter("model_server_loads_total", "Load attempts", ["outcome"], registry=r)
        self.m_ahead = Counter("model_server_read_ahead_bytes_total",
                               "Bytes read and verified ahead of their load, while distribution finished", registry=r)
        self.ahead = Preparer(self.read_ahead_bytes, self.m_ahead.inc)
        self._warming: dict[VersionKey, asyncio.Task] = {}      # engines started ahead of their load
        self._warm_files: dict[VersionKey, int] = {}            # the newest count of whole files, by version
        self._lock = asyncio.Lock()
        self.fault_count = 0

    def in_use(self) -> int:
        return sum(v.nbytes for v in self.versions.values() if v.state == "ready")

    async def prepare(self, key: VersionKey | tuple[str, str], path: Path, files: int) -> dict:
        """Read ahead the first ``files`` files of a version still arriving (serving/prepare.py); a
        version this server may not load is refused here as at load."""
        key = VersionKey(*key)
        cur = self.versions.get(key)
        if cur is not None and cur.state in ("ready", "loading"):
            return {"files_wanted": 0, "files_read": 0, "bytes_held": 0, "note": f"already {cur.state}"}
        await asyncio.to_thread(self.trust.check, Path(path))
        out = await self.ahead.want(key, Path(path), files)
        self._warm_soon(key, Path(path), files)
        return out

    def _warm_soon(self, key: VersionKey, path: Path, files: int) -> None:
        """Start the version's engine ahead of its load where the engine can (serving/vllm_engine.py),
        in the background (a start takes seconds to minutes); asked again on each prepare until the
        files it needs are there."""
        warm = getattr(self.engine, "warm", None)
        if warm is None:
            return
        self._warm_files[key] = max(files, self._warm_files.get(key, 0))
        task = self._warming.get(key)
        if task is not None and (not task.done() or task.result()):
            return                              # a start under way asks again with the newest count
        self._warming[key] = asyncio.create_task(self._warm(warm, key, path))

    async def _warm(self, warm, key: VersionKey, path: Path) -> bool:
        """True once settled: started, failed (the load then fails or starts cold, and says why), or never
        (an engine that does not start ahead); False: asked again on the next prepare."""
        what = {"model": key.model, "version": key.version}
        try:
            started, asked = False, 0
            while started is False and asked < self._warm_files.get(key, 0):   # a prepare may come meanwhile
                asked = self._warm_files[key]
                started = await asyncio.to_thread(warm, key, path, asked, self.memory_budget, self.in_use())
        except (LoadError, VerifyError) as e:
            log.warning("engine not started ahead of the load", extra={**what, "error": str(e)})
            return True
        except Exception:
            # only ever a head start: whatever went wrong, the load reads and checks everything again
            log.exception("engine not started ahead of the load", extra=what)
            return True
        if started:
            log.info("engine started ahead of the load", extra=what)
        return started is not False           # None: this engine never starts ahead

    async def load(self, key: VersionKey | tuple[str, str], path: Path) -> VersionState:
        key = VersionKey(*key)
        if key in self._warming and self._warming[key].done():
            del self._warming[key]
            self._warm_files.pop(key, None)
        held = await self.ahead.stop(Path(path))   # what was read ahead stays for this load; nothing is read twice
        try:
            vs = await self._load(key, path)
        finally:
            freed = await self.ahead.forget(Path(path))
        if held and vs.state == "ready":
            vs.read_ahead_bytes = held - freed
        return vs

    async def _load(self, key: VersionKey, path: Path) -> VersionState:
        async with self._lock:   # one load at a time per host
            cur = self.versions.get(key)
            if cur and cur.state == "ready":
                return cur
            ready = [k for k, s in self.versions.items() if s.state == "ready"]
            if len(ready) >= self.max_versions:
                vs = VersionState("failed", f"already holding {len(ready)} versions "
                                            f"({', '.join('/'.join(k) for k in sorted(ready))}); unload one first",
                                  "capacity", path=str(path))
                self.versions[key] = vs
                return vs
            vs = self.versions[key] = VersionState("loading", path=str(path))
            what = {"model": key.model, "version": key.version}
            try:
                fault = self.faults.get(key, {})
                await asyncio.sleep(fault.get("load_delay_s", 0.0))   # drills: a slow load
                if "load_gate" in fault:
                    await fault["load_gate"].wait()                  # ... or one held until the drill says
                await asyncio.to_thread(self.trust.check, Path(path))
                vs.nbytes = await asyncio.to_thread(self.engine.load, key, path, self.memory_budget, self.in_use())
                if self.versions.get(key) is not vs:
                    # unloaded while it was loading (an aborted rollout): the unload wins, nothing stays resident
                    self.engine.unload(key)
                    vs.state, vs.reason, vs.code = "failed", "unloaded while it was loading", "unloaded"
                    self.m_loads.labels("unloaded").inc()
                    log.info("load discarded: unloaded meanwhile", extra=what)
                    return vs
                vs.state = "ready"
                self.m_loads.labels("ok").inc()
                self.m_ready.labels(*key).set(1)
                log.info("version ready", extra={**what, "bytes": vs.nbytes})
            except LoadError as e:
                vs.state, vs.reason, vs.code = "failed", str(e), e.code
                self.m_loads.labels(e.code).inc()
                log.warning("load failed", extra={**what, "code": e.code, "error": str(e)})
            return vs

    def unload(self, key: VersionKey | tuple[str, str]) -> bool:
        key = VersionKey(*key)
        self._warm_files.pop(key, None)          # a start ahead still running asks no more for it
        if key in self._warming and self._warming[key].done():
            del self._warming[key]
        vs = self.versions.pop(key, None)
        if vs is None:
            return False
        self.engine.unload(key)
        self.m_ready.labels(*key).set(0)
        return True


def make_app(ms: ModelServer) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)

    def key_arg(b) -> VersionKey:
        """(model, model_version) of a request body or query: both names, both required."""
        model, v = b.get("model"), b.get("model_version")
        if not isinstance(model, str) or not _VERSION.match(model):
            raise bad_request(f"model {model!r} must be a model name matching {_VERSION.pattern} "
                              "(a host serves several models; say which)")
        if not isinstance(v, str) or not _VERSION.match(v):
            raise bad_request(f"model_version {v!r} must match {_VERSION.pattern}")
        return VersionKey(model, v)

    async def body(request) -> dict:
        return await json_object(request)

    async def ready(request):
        key = key_arg(request.query)
        vs = ms.versions.get(key)
        if vs is None:
            return web.json_response({"ready": False, "reason": f"{key.model} {key.version} is not loaded on "
                                                                f"{ms.host_id}"}, status=503)
        if vs.state != "ready":
            return web.json_response({"ready": False, "state": vs.state, "reason": vs.reason, "code": vs.code}, status=503)
        return web.json_response({"ready": True, "model": key.model, "version": key.version, "host": ms.host_id})

    def admin(request) -> None:
        if ms.admin_token and not bearer_ok(request, ms.admin_token):
            raise web.HTTPUnauthorized(text=json.dumps({"error": "load and unload need the admin token "
                                                                 "(Authorization: Bearer <token>)"}),
                                       content_type="application/json")

    def store_path(b: dict) -> Path:
        """``version_id`` (or a legacy ``path``) → the version's model directory in peerd's store."""
        if ms.store_root is None:
            raise web.HTTPForbidden(text=json.dumps({"error": f"{ms.host_id} has no peerd store configured "
                                                              "(--store); it loads nothing"}),
                                    content_type="application/json")
        root = (Path(ms.store_root) / "versions").resolve()
        vid, path = b.get("version_id"), b.get("path")
        if vid is not None:
            if not isinstance(vid, str) or not _VID.match(vid):
                raise bad_request(f"version_id {vid!r} must be 64 lowercase hex characters")
            target = root / vid / "model"
        elif isinstance(path, str) and path and "\x00" not in path:
            target = Path(path).resolve()
            if target.parent.parent != root or not _VID.match(target.parent.name) or target.name != "model":
                raise bad_request(f"path {path!r} is not a version in this host's peerd store "
                                  f"({root}/<version id>/model); send version_id instead")
        else:
            raise bad_request("give version_id: the version to load from peerd's store")
        if not target.is_dir():
            raise web.HTTPNotFound(text=json.dumps({"error": f"version {target.parent.name[:12]}… is not in "
                                                             f"{ms.host_id}'s peerd store"}),
                                   content_type="application/json")
        return target

    async def load(request):
        admin(request)
        b = await body(request)
        key = key_arg(b)
        vs = await ms.load(key, store_path(b))
        status = 200 if vs.state == "ready" else 409
        return web.json_response({"model": key.model, "model_version": key.version, **vs.__dict__}, status=status)

    async def prepare(request):
        admin(request)
        b = await body(request)
        key = key_arg(b)
        files = b.get("files")
        if not isinstance(files, int) or isinstance(files, bool) or files < 0:
            raise bad_request(f"files {files!r} must be a count (the manifest's first files peerd has verified)")
        try:
            out = await ms.prepare(key, store_path(b), files)
        except LoadError as e:
            return web.json_response({"model": key.model, "model_version": key.version, "code": e.code,
                                      "reason": str(e)}, status=409)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=409)
        return web.json_response({"model": key.model, "model_version": key.version, **out})

    async def unload(request):
        admin(request)
        b = await body(request)
        key = key_arg(b)
        await ms.ahead.forget_version(key)      # an aborted rollout's read-ahead goes with it
        if not ms.unload(key):
            return web.json_response({"error": f"{key.model} {key.version} is not loaded on {ms.host_id}"}, status=404)
        return web.json_response({"unloaded": {"model": key.model, "version": key.version}})

    async def versions(_):
        """Every version held, as a list: ``[{model, version, state, ...}]``."""
        return web.json_response({"host": ms.host_id, "device": ms.engine.device(),
                                  "versions": [{"model": k.model, "version": k.version, **s.__dict__}
                                               for k, s in sorted(ms.versions.items())]})

    async def infer(request):
        b = await body(request)
        key = key_arg(b)
        v = key.version
        ids = b.get("input_ids")
        if (not isinstance(ids, list) or not ids or len(ids) > 64 or
                not all(isinstance(r, list) and 0 < len(r) <= 64 and all(type(x) is int and 0 <= x < 2**31 for x in r)
                        for r in ids) or len({len(r) for r in ids}) != 1):
            return web.json_response({"error": "input_ids must be 1-64 equal-length rows of 1-64 token ids"},
                                     status=400)
        vs = ms.versions.get(key)
        if vs is None or vs.state != "ready":
            ms.m_requests.labels(*key, "not_ready").inc()
            known = vs is not None
            return web.json_response({"error": f"{key.model} {v} is not ready on {ms.host_id}"},
                                     status=409 if known else 404)
        fault = ms.faults.get(key)
        if fault:
            ms.fault_count += 1
            await asyncio.sleep(fault.get("delay_s", 0.0))
            if fault.get("error_every") and ms.fault_count % fault["error_every"] == 0:
                ms.m_requests.labels(*key, "injected_error").inc()
                return web.json_response({"error": "injected fault"}, status=500)
        try:
            _within_vocab(ms, key, [t for row in ids for t in row])
            out = await asyncio.to_thread(ms.engine.infer, key, ids)
        except VersionGone:
            ms.m_requests.labels(*key, "not_ready").inc()
            return web.json_response({"error": f"{key.model} {v} was unloaded from {ms.host_id} meanwhile"}, status=409)
        ms.m_requests.labels(*key, "ok").inc()
        return web.json_response({"model": key.model, "model_version": v, "host": ms.host_id, **out},
                                 headers={"X-Model": key.model, "X-Model-Version": v})

    async def generate(request):
        """New token ids after a prompt's token ids (the router's OpenAI API detokenizes them)."""
        b = await body(request)
        key = key_arg(b)
        ids, n = b.get("input_ids"), b.get("max_tokens", 16)
        temperature, top_p, seed = b.get("temperature", 0.0), b.get("top_p", 1.0), b.get("seed")
        if (not isinstance(ids, list) or not 0 < len(ids) <= 8192 or not all(type(t) is int and t >= 0 for t in ids)
                or type(n) is not int or not 1 <= n <= 1024
                or not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 10
                or not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1
                or (seed is not None and type(seed) is not int)):
            raise bad_request("give input_ids (1-8192 token ids), max_tokens in [1, 1024], temperature in [0, 10], "
                              "top_p in (0, 1] and an integer seed (or none)")
        vs = ms.versions.get(key)
        if vs is None or vs.state != "ready":
            return web.json_response({"error": f"{key.model} {key.version} is not ready on {ms.host_id}"},
                                     status=409 if vs else 404)
        try:
            _within_vocab(ms, key, ids)
            out = await asyncio.to_thread(ms.engine.generate, key, ids, n, float(temperature), float(top_p), seed)
        except VersionGone:
            return web.json_response({"error": f"{key.model} {key.version} was unloaded meanwhile"}, status=409)
        except NotImplementedError as e:
            raise bad_request(str(e)) from None
        ms.m_requests.labels(*key, "ok").inc()
        return web.json_response({"model": key.model, "model_version": key.version, "host": ms.host_id,
                                  "output_ids": out}, headers={"X-Model": key.model, "X-Model-Version": key.version})

    async def stop_engines(_):
        await asyncio.to_thread(ms.engine.stop_all)       # engine processes (vLLM servers) go with the server

    app.router.add_get("/health/ready", ready)
    app.router.add_post("/v1/generate", generate)
    openai_host.add_routes(app, ms)
    if hasattr(ms.engine, "stop_all"):
        app.on_cleanup.append(stop_engines)
    app.router.add_post("/v1/prepare", prepare)
    app.router.add_post("/v1/load", load)
    app.router.add_post("/v1/unload", unload)
    app.router.add_get("/v1/versions", versions)
    app.router.add_post("/v1/infer", infer)
    app.router.add_get("/metrics", metrics_handler(ms.registry))
    return app


def _within_vocab(ms: ModelServer, key: VersionKey, ids: list[int]) -> None:
    vocab = ms.engine.vocab(key)
    if max(ids) >= vocab:
        ms.m_requests.labels(*key, "bad_request").inc()
        raise bad_request(f"input_ids holds token id {max(ids)}; {key.model} {key.version} has {vocab} tokens")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="model-server")
    ap.add_argument("--id", required=True)
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--listen", default="127.0.0.1")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="seconds to send a request head (default 10)")
    ap.add_argument("--body-timeout", type=float, default=60.0,
                    help="seconds a request's body may take to arrive after its head (default 60)")
    ap.add_argument("--ready-file", type=Path, help="write {addr} JSON here once listening")
    ap.add_argument("--max-versions", type=int, default=2)
    ap.add_argument("--memory-budget", type=int, default=None,
                    help="bytes this host's versions may take: weights plus each engine's KV-cache reserve")
    ap.add_argument("--kv-cache-tokens", type=int, default=KV_CACHE_TOKENS,
                    help="tokens of KV cache each Hugging Face version reserves (counted against the budget)")
    ap.add_argument("--store", type=Path, required=True, help="peerd's store root: versions load only from under it")
    add_secret_file_arg(ap, ADMIN_TOKEN, "admin token (load/unload, the admin API); required")
    ap.add_argument("--trusted-key", type=Path, action="append", default=[],
                    help="a public key whose signed versions this server loads (repeatable); required")
    ap.add_argument("--allow-pinned", action="store_true",
                    help="also load pinned versions (unsigned training checkpoints peerd took on the cluster "
                         "token's word); off for a fleet that serves releases")
    ap.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                    help="what runs Hugging Face checkpoints: transformers in this process, or a vLLM server per "
                         "version (from `make vllm-venv`, or --vllm-python)")
    ap.add_argument("--vllm-python", help="the vLLM virtualenv's python (default $WEIGHTCAST_VLLM_PYTHON or "
                                          ".venv-vllm/bin/python)")
    ap.add_argument("--vllm-optimization-level", type=int, choices=(0, 1, 2, 3), default=None,
                    help="vLLM's -O level for each server it starts (default: vLLM's own): 0 starts fastest, "
                         "without torch.compile or CUDA graphs")
    ap.add_argument("--vllm-start-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="start a version's vLLM server on stand-in weights as soon as every file but its weights "
                         "is verified, so the start overlaps the weights' distribution and the load only reloads "
                         "the weights in place; the server holds the version's memory from then on (default: on)")
    return ap


def engine_for(a) -> Engine:
    return make_engine(a.engine, a.store.parent / "vllm", a.vllm_python, a.kv_cache_tokens, a.vllm_optimization_level,
                       a.vllm_start_ahead)


def make_engine(name: str = "transformers", workdir: Path | None = None, vllm_python: str | None = None,
                kv_cache_tokens: int = KV_CACHE_TOKENS, vllm_optimization_level: int | None = None,
                vllm_start_ahead: bool = True) -> Engine:
    """The model server's engine: Hugging Face checkpoints on ``name`` (transformers in this process, or
    vLLM servers started under ``workdir``), weightcast's reference checkpoints on the reference engine."""
    if name == "vllm":
        from serving.vllm_engine import VllmEngine
        return AutoEngine(hf=VllmEngine(workdir, python=vllm_python, kv_cache_tokens=kv_cache_tokens,
                                        optimization_level=vllm_optimization_level, start_ahead=vllm_start_ahead))
    return AutoEngine(hf=TransformersEngine(kv_cache_tokens=kv_cache_tokens))


def main(argv=None) -> int:
    from lib.logging_setup import setup
    a = build_parser().parse_args(argv)
    setup()
    admin_token = read_secret(a, ADMIN_TOKEN)
    if not admin_token:
        print(json.dumps({"level": "ERROR", "msg": "no admin token: set WEIGHTCAST_ADMIN_TOKEN (from a secret) "
                                                   "or --admin-token-file; load/unload must be authenticated"}), file=sys.stderr)
        return 2
    if not a.trusted_key:
        print(json.dumps({"level": "ERROR", "msg": "no --trusted-key: the model server loads only versions signed "
                                                   "by a key it trusts"}), file=sys.stderr)
        return 2
    trust = ManifestTrust(tuple(load_public_key(k) for k in a.trusted_key), allow_pinned=a.allow_pinned)
    ms = ModelServer(a.id, engine=engine_for(a), max_versions=a.max_versions, memory_budget=a.memory_budget,
                     store_root=a.store, admin_token=admin_token, trust=trust)
    run_guarded(make_app(ms), a.listen, a.port, header_timeout=a.header_timeout,
                body_timeout=a.body_timeout, ready_file=a.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
