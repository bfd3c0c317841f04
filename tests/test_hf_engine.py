"""Hugging Face checkpoints (Llama, Qwen2, GPT-2, built and trained here, bf16, sharded) through peerd's
store into the model server's transformers engine over real HTTP: loaded from the verified bytes with no
second copy, ready only after reproducing the golden prompts recorded at publish, and refused when a
shard is corrupt, the tokenizer is missing, the manifest carries no golden prompts or they do not match."""
import json
import shutil

import aiohttp
import pytest
import torch

from serving import golden, hf_build
from serving.engine import VersionKey
from serving.hf_engine import TransformersEngine
from serving.server import ModelServer, make_app
from tests.serving_fixtures import store_root, store_version
from tests.test_model_server import ADM, ADMIN, call, serve



def test_the_fixtures_are_real_hugging_face_directories(hf_checkpoints):
    for arch, (d, g) in hf_checkpoints.items():
        names = {p.name for p in d.iterdir()}
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors.index.json"} <= names, names
        assert sum(n.startswith("model-0000") and n.endswith(".safetensors") for n in names) >= 2   # sharded
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
        tok_cfg = {**json.loads((d / "tokenizer_config.json").read_text())}
        chat = tok_cfg.get("chat_template") or (d / "chat_template.jinja").read_text()
        assert "add_generation_prompt" in chat
        assert sum(len(p["output_ids"]) for p in g["prompts"]) >= golden.MIN_TOKENS


def test_the_golden_rule_keeps_only_decisive_tokens_and_tells_models_apart(hf_checkpoints):
    d, g = hf_checkpoints["llama"]
    for p in g["prompts"]:                    # every kept token is decisive by the stated margin
        assert p["min_margin"] >= g["safety"] * g["deviation"]
    from transformers import AutoModelForCausalLM
    same = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    other = AutoModelForCausalLM.from_pretrained(hf_checkpoints["qwen2"][0], dtype=torch.bfloat16)

    def greedy(model):
        from serving.hf_engine import _greedy
        return lambda ids, n: _greedy(model, ids, n, torch.device("cpu"))
    assert golden.check(greedy(same), g) >= golden.MIN_TOKENS     # bf16, with a KV cache: still the same tokens
    with pytest.raises(golden.GoldenMismatch):
        golden.check(greedy(other), g)
    with pytest.raises(golden.GoldenError, match="too close to call|at least"):
        golden.record(d, prompts=("x",), max_new_tokens=golden.MIN_TOKENS - 1)   # too few tokens to tell


async def test_each_architecture_loads_from_verified_bytes_and_answers(tmp_path, keys, hf_checkpoints):
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN, max_versions=3)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            for arch, (src, g) in hf_checkpoints.items():
                d = store_version(tmp_path, src, arch, "v1", keys["private"], serving={"golden": g})
                st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                         json={"model": arch, "model_version": "v1", "version_id": d.parent.name})
                assert st == 200 and body["state"] == "ready", body
                assert (await call(s, "GET", addr + f"/health/ready?model={arch}&model_version=v1"))[0] == 200
                p = g["prompts"][0]
                st, body, hdr = await call(s, "POST", addr + "/v1/generate", json={
                    "model": arch, "model_version": "v1", "input_ids": p["input_ids"],
                    "max_tokens": len(p["output_ids"])})
                assert st == 200 and hdr["X-Model"] == arch
                eos = hf_build.tokenizer().eos_token_id
                want = p["output_ids"][:p["output_ids"].index(eos)] if eos in p["output_ids"] else p["output_ids"]
                assert body["output_ids"] == want                      # greedy, stopping at end-of-text
                st, body, _ = await call(s, "POST", addr + "/v1/generate", json={
                    "model": arch, "model_version": "v1", "input_ids": [1, 2, 99999]})
                assert st == 400 and "token id 99999" in body["error"]   # the client's mistake, checked first
                st, _, _ = await call(s, "POST", addr + "/v1/infer", json={
                    "model": arch, "model_version": "v1", "input_ids": [p["input_ids"]]})
                assert st == 200
            # the parameters are the verified tensors themselves, in the checkpoint's dtype
            model = ms.engine.hf.models[VersionKey("llama", "v1")].model
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    finally:
        await runner.cleanup()


async def test_bad_hugging_face_checkpoints_never_become_ready(tmp_path, keys, hf_checkpoints):
    src, g = hf_checkpoints["llama"]
    engine = TransformersEngine(torch.device("cpu"))

    def load(d, version):
        from serving.loader import LoadError
        with pytest.raises(LoadError) as e:
            engine.load(VersionKey("llama", version), d, None, 0)
        return e.value

    # a shard altered on disk after verification (same size and times): refused while it is read
    d = store_version(tmp_path, src, "llama", "corrupt", keys["private"], serving={"golden": g})
    shard = sorted(d.glob("model-0000*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    import os
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert load(d, "corrupt").code in ("altered",)
    # no golden prompts in the manifest: nothing could show the weights are right
    assert load(store_version(tmp_path, src, "llama", "nogolden", keys["private"]), "nogolden").code == "unverifiable"
    # golden prompts that the weights do not reproduce (another model's): never ready
    other = hf_checkpoints["qwen2"][1]
    assert load(store_version(tmp_path, src, "llama", "wronggolden", keys["private"], serving={"golden": other}),
                "wronggolden").code == "smoke_failed"
    # a directory without its tokenizer: it could not turn text into tokens or back, so it is refused
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / "tokenizer.json").unlink()
    e = load(store_version(tmp_path, bare, "llama", "notokenizer", keys["private"], serving={"golden": g}),
             "notokenizer")
    assert e.code == "bad_checkpoint" and "tokenizer" in str(e)
    assert engine.models == {}                                   # nothing stayed loaded


async def test_a_version_takes_its_weights_and_its_kv_cache_from_the_budget(tmp_path, keys, hf_checkpoints):
    """The budget counts the weights and the KV cache the engine reserves (2 × layers × KV heads ×
    head dim × dtype bytes a token): a budget that holds the weights alone is refused before the weights
    are read; one that holds the version is filled by it, and a second version does not fit beside it."""
    from serving.auto_engine import AutoEngine
    from serving.footprint import kv_bytes_per_token
    src, g = hf_checkpoints["llama"]
    cfg = json.loads((src / "config.json").read_text())
    per_token = kv_bytes_per_token(cfg)
    assert per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2   # bf16
    weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    tokens = 4096
    need = weights + tokens * per_token
    dirs = [store_version(tmp_path, src, "llama", v, keys["private"], serving={"golden": g}) for v in ("v1", "v2")]

    small = ModelServer("h1", engine=AutoEngine(hf=TransformersEngine(kv_cache_tokens=tokens)),
                        store_root=store_root(tmp_path), admin_token=ADMIN, memory_budget=need - 1)
    vs = await small.load(("llama", "v1"), dirs[0])
    assert vs.state == "failed" and vs.code == "oom"
    assert f"{weights} of weights" in vs.reason and f"{tokens * per_token}-byte KV cache" in vs.reason

    ms = ModelServer("h1", engine=AutoEngine(hf=TransformersEngine(kv_cache_tokens=tokens)),
                     store_root=store_root(tmp_path), admin_token=ADMIN, memory_budget=need + need // 2)
    vs = await ms.load(("llama", "v1"), dirs[0])
    assert vs.state == "ready" and vs.nbytes == need and ms.in_use() == need
    vs = await ms.load(("llama", "v2"), dirs[1])
    assert vs.state == "failed" and vs.code == "oom" and f"{need} of the" in vs.reason
    assert ms.unload(("llama", "v1"))
    assert (await ms.load(("llama", "v2"), dirs[1])).state == "ready"


def test_a_build_cache_copies_what_the_same_build_wrote_and_keeps_other_builds_apart(tmp_path, monkeypatch):
    from serving import hf_build
    monkeypatch.setenv(hf_build.CACHE_ENV, str(tmp_path / "cache"))

    def files(d):
        return {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    first = hf_build.build("llama", tmp_path / "a", seed=3, train_steps=2)
    again = hf_build.build("llama", tmp_path / "b", seed=3, train_steps=2)
    other = hf_build.build("llama", tmp_path / "c", seed=4, train_steps=2)
    assert files(again) == files(first) and any(n.endswith(".safetensors") for n in files(first))
    assert files(other) != files(first)                     # another seed: another build, not the cached one
    assert len([d for d in (tmp_path / "cache").iterdir() if d.is_dir()]) == 2
    monkeypatch.delenv(hf_build.CACHE_ENV)
    assert files(hf_build.build("llama", tmp_path / "d", seed=3, train_steps=2)) == files(first)   # built anew: the same
