"""The model server over real HTTP on loopback."""
import aiohttp
from aiohttp import web

from peerd.signing import generate_keypair, load_private_key
from serving.server import ModelServer, make_app
from serving.trust import ManifestTrust
from tests.serving_fixtures import store_root, verified_version
from tests.waiting import until

ADMIN = "admin-secret"
ADM = {"Authorization": f"Bearer {ADMIN}"}


async def serve(app) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def call(s, method, url, **kw):
    async with s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


async def test_readiness_is_per_version_and_fails_closed(tmp_path, keys):
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    v2 = verified_version(tmp_path, "v2", seed=2, key=keys["private"])
    ms = ModelServer("h1", memory_budget=None, store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 503   # nothing loaded
            st, body, _ = await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v1", "path": str(v1)}, headers=ADM)
            assert st == 200 and body["state"] == "ready"
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 200
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v2"))[0] == 503
            st, body, hdr = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": [[1, 2, 3]]})
            assert st == 200 and hdr["X-Model-Version"] == "v1" and len(body["next_token"]) == 1
            st, body, _ = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v9", "input_ids": [[1]]})
            assert st == 404 and "v9" in body["error"]
            # two versions side by side, then the old one unloaded
            st, _, _ = await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v2", "path": str(v2)}, headers=ADM)
            assert st == 200
            a = (await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": [[5, 6]]}))[1]
            b = (await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v2", "input_ids": [[5, 6]]}))[1]
            assert a["logits_head"] != b["logits_head"]
            assert (await call(s, "POST", addr + "/v1/unload", json={"model": "tiny", "model_version": "v1"}, headers=ADM))[0] == 200
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 503
            # bad input: clear 4xx
            assert (await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v2", "input_ids": [[9999]]}))[0] == 400
            assert (await call(s, "POST", addr + "/v1/infer", data=b"{"))[0] == 400
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=../x"))[0] == 400
            assert (await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v3", "path": "/nonexistent"}, headers=ADM))[0] == 400
            async with s.get(addr + "/metrics") as r:
                text = await r.text()
            assert 'model_server_requests_total{model="tiny",outcome="ok",version="v1"}' in text
    finally:
        await runner.cleanup()


async def test_oom_during_load_keeps_the_old_version_serving(tmp_path, keys):
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    v2 = verified_version(tmp_path, "v2", seed=2, key=keys["private"])
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            assert (await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v1", "path": str(v1)}, headers=ADM))[0] == 200
            ms.memory_budget = ms.in_use() + 10            # room for v1 only
            st, body, _ = await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v2", "path": str(v2)}, headers=ADM)
            assert st == 409 and body["code"] == "oom" and "Unload" in body["reason"]
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v2"))[0] == 503
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 200
            st, body, _ = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": [[1]]})
            assert st == 200
    finally:
        await runner.cleanup()


async def test_load_and_unload_need_the_admin_token_and_load_only_from_the_store(tmp_path, keys):
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    # a copy of a verified version outside peerd's store, verified.json and all: never loaded
    rogue = tmp_path / "elsewhere" / "versions" / v1.parent.name / "model"
    rogue.parent.mkdir(parents=True)
    import shutil
    shutil.copytree(v1, rogue)
    shutil.copy(v1.parent / "manifest.json", rogue.parent / "manifest.json")
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            for hdr in ({}, {"Authorization": "Bearer wrong"}):
                st, body, _ = await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v1",
                                                                           "version_id": v1.parent.name}, headers=hdr)
                assert st == 401 and "admin token" in body["error"]
                assert (await call(s, "POST", addr + "/v1/unload", json={"model": "tiny", "model_version": "v1"}, headers=hdr))[0] == 401
            for path in (str(rogue), str(v1 / ".." / ".." / ".." / ".." / "elsewhere"), str(tmp_path)):
                st, body, _ = await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v1", "path": path},
                                         headers=ADM)
                assert st == 400 and "peerd store" in body["error"]
            st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                     json={"model": "tiny", "model_version": "v1", "version_id": "f" * 64})
            assert st == 404
            st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                     json={"model": "tiny", "model_version": "v1", "version_id": ["not", "a", "string"]})
            assert st == 400
            assert ms.versions == {}
            st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                     json={"model": "tiny", "model_version": "v1", "version_id": v1.parent.name})
            assert st == 200 and body["state"] == "ready"
            # a malformed inference request is the client's fault: 400, and the server stays ready
            for bad in ([[True]], [[1.0]], [["1"]], [[1], [1, 2]], "x"):
                st, body, _ = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": bad})
                assert st == 400, bad
            assert (await call(s, "POST", addr + "/v1/infer", data=b"[" * 50_000))[0] == 400
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 200
    finally:
        await runner.cleanup()


async def test_a_request_racing_an_unload_gets_409_not_500(tmp_path, keys):
    """The unload lands between the server's readiness check and the inference thread (seen under load
    during an automatic rollback): the client hears "unloaded meanwhile", and nothing is logged as a crash."""
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            assert (await call(s, "POST", addr + "/v1/load", json={"model": "tiny", "model_version": "v1", "path": str(v1)},
                               headers=ADM))[0] == 200
            ms.engine.unload(("tiny", "v1"))                        # the engine lets go first, the state still says ready
            st, body, _ = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": [[1]]})
            assert st == 409 and "unloaded" in body["error"]
    finally:
        await runner.cleanup()


async def test_the_same_label_in_two_models_is_two_versions(tmp_path, keys):
    """A host serves several models: (model, version) is the key everywhere, so "v1" of two models
    loads, answers, reports readiness and unloads on its own; a request that does not say which model,
    or names the wrong one for the stored bytes, is refused."""
    tiny = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    other = verified_version(tmp_path, "v1", seed=2, key=keys["private"], model="other")
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    try:
        async with aiohttp.ClientSession() as s:
            for model, d in (("tiny", tiny), ("other", other)):
                st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                         json={"model": model, "model_version": "v1", "version_id": d.parent.name})
                assert st == 200 and body["state"] == "ready" and body["model"] == model
            a = await call(s, "POST", addr + "/v1/infer", json={"model": "tiny", "model_version": "v1", "input_ids": [[5, 6]]})
            b = await call(s, "POST", addr + "/v1/infer", json={"model": "other", "model_version": "v1", "input_ids": [[5, 6]]})
            assert a[0] == b[0] == 200 and a[2]["X-Model"] == "tiny" and b[2]["X-Model"] == "other"
            assert a[1]["logits_head"] != b[1]["logits_head"]          # two checkpoints, not one
            st, body, _ = await call(s, "GET", addr + "/v1/versions")
            assert sorted((v["model"], v["version"], v["state"]) for v in body["versions"]) == [
                ("other", "v1", "ready"), ("tiny", "v1", "ready")]
            assert (await call(s, "POST", addr + "/v1/unload", json={"model": "tiny", "model_version": "v1"},
                               headers=ADM))[0] == 200
            assert (await call(s, "GET", addr + "/health/ready?model=tiny&model_version=v1"))[0] == 503
            assert (await call(s, "GET", addr + "/health/ready?model=other&model_version=v1"))[0] == 200
            # no model named: a clear 400, never a guess
            st, body, _ = await call(s, "GET", addr + "/health/ready?model_version=v1")
            assert st == 400 and "model" in body["error"]
            st, body, _ = await call(s, "POST", addr + "/v1/infer", json={"model_version": "v1", "input_ids": [[1]]})
            assert st == 400 and "model" in body["error"]
            # bytes of model "other" asked for as model "tiny": refused as the wrong version
            st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                     json={"model": "tiny", "model_version": "v1", "version_id": other.parent.name})
            assert st == 409 and body["code"] == "wrong_version" and "other" in body["reason"]
            assert ("tiny", "v1") not in {k for k, v in ms.versions.items() if v.state == "ready"}
            # no room left: the load says which versions of which models hold it, and nothing is unloaded
            ms.max_versions = 1
            st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM,
                                     json={"model": "tiny", "model_version": "v1", "version_id": tiny.parent.name})
            assert st == 409 and body["code"] == "capacity" and "other/v1" in body["reason"]
            assert ms.versions[("other", "v1")].state == "ready"
    finally:
        await runner.cleanup()


async def test_only_versions_signed_by_a_trusted_key_load_and_pinned_ones_only_when_allowed(tmp_path, keys):
    """peerd verified all three against their manifests; the model server still decides whose manifest
    it serves: the fleet's signing key, not another key, and no pinned (unsigned) checkpoint unless
    it was started with --allow-pinned."""
    generate_keypair(tmp_path / "other.pem", tmp_path / "other.pub")
    dirs = {"signed": verified_version(tmp_path, "v1", seed=1, key=keys["private"]),
            "other-key": verified_version(tmp_path, "v2", seed=2, key=load_private_key(tmp_path / "other.pem")),
            "pinned": verified_version(tmp_path, "v3", seed=3, key=None, pinned=True)}
    versions = {"signed": "v1", "other-key": "v2", "pinned": "v3"}
    for allow_pinned in (False, True):
        ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN,
                         trust=ManifestTrust((keys["public"],), allow_pinned=allow_pinned), max_versions=3)
        runner, addr = await serve(make_app(ms))
        try:
            async with aiohttp.ClientSession() as s:
                got = {}
                for name, d in dirs.items():
                    st, body, _ = await call(s, "POST", addr + "/v1/load", headers=ADM, json={
                        "model": "tiny", "model_version": versions[name], "version_id": d.parent.name})
                    got[name] = (st, body.get("code"), body.get("reason", ""))
        finally:
            await runner.cleanup()
        assert got["signed"][:2] == (200, "")
        assert got["other-key"][:2] == (409, "untrusted") and "does not verify against the trusted keys" in got["other-key"][2], got
        if allow_pinned:
            assert got["pinned"][:2] == (200, "")
        else:
            assert got["pinned"][:2] == (409, "untrusted") and "--allow-pinned" in got["pinned"][2], got


async def test_files_read_ahead_are_verified_once_and_taken_by_the_load(tmp_path, keys):
    """The host activity names the files peerd has verified whole; the server reads and hashes them
    ahead, and the load takes those bytes instead of reading them again."""
    import json

    from tests.waiting import until
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    files = json.loads((v1.parent / "manifest.json").read_bytes())["manifest"]["files"]
    ahead = sum(f["size"] for f in files[:-1])
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    runner, addr = await serve(make_app(ms))
    body = {"model": "tiny", "model_version": "v1", "version_id": v1.parent.name}
    try:
        async with aiohttp.ClientSession() as s:
            for bad in (-1, "3", True, None):
                st, out, _ = await call(s, "POST", addr + "/v1/prepare", json={**body, "files": bad}, headers=ADM)
                assert st == 400 and "files" in out["error"]
            st, _, _ = await call(s, "POST", addr + "/v1/prepare", json={**body, "version_id": "0" * 64, "files": 1},
                                  headers=ADM)
            assert st == 404
            st, out, _ = await call(s, "POST", addr + "/v1/prepare", json={**body, "files": len(files) - 1}, headers=ADM)
            assert st == 200 and out["files_wanted"] == len(files) - 1

            async def read_ahead() -> float:
                async with s.get(addr + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("model_server_read_ahead_bytes_total "):
                            return float(line.split()[1])
                return 0.0
            assert await until(lambda: _equals(read_ahead(), ahead), 30, "every file but the last read ahead")
            st, out, _ = await call(s, "POST", addr + "/v1/load", json=body, headers=ADM)
            assert st == 200 and out["state"] == "ready" and out["read_ahead_bytes"] == ahead
            st, out, _ = await call(s, "POST", addr + "/v1/prepare", json={**body, "files": len(files)}, headers=ADM)
            assert st == 200 and out["note"] == "already ready"
    finally:
        await runner.cleanup()


async def _equals(aw, want) -> bool:
    return await aw == want


async def test_a_start_ahead_asks_again_with_the_files_told_while_it_ran(tmp_path):
    """A prepare that arrives while the engine's start ahead is still deciding (not yet: the frame was not
    whole) is not lost: the start asks again with the newest count before it settles."""
    import asyncio
    import threading
    from serving.engine import ReferenceEngine, VersionKey

    class Engine(ReferenceEngine):
        def __init__(self):
            super().__init__()
            self.asked, self.first = [], threading.Event()

        def warm(self, key, model_dir, files_ready, memory_budget, in_use):
            self.asked.append(files_ready)
            if len(self.asked) == 1:
                self.first.wait(10)           # the next prepare arrives meanwhile
            return files_ready >= 5 or False

    engine = Engine()
    ms = ModelServer("h1", engine=engine)
    key = VersionKey("m", "v1")
    ms._warm_soon(key, tmp_path, 2)
    await until(lambda: engine.asked, 10, "the first ask under way")
    ms._warm_soon(key, tmp_path, 5)              # while the first ask runs
    engine.first.set()
    assert await ms._warming[key] is True
    assert engine.asked == [2, 5]
    ms._warm_soon(key, tmp_path, 6)              # settled: not asked again
    assert engine.asked == [2, 5]
    assert ms.unload(key) is False and key not in ms._warm_files and key not in ms._warming   # nothing kept for it
