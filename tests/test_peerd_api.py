"""Bad input at peerd's HTTP API: clear 4xx answers, and the daemon keeps running."""
import asyncio
import dataclasses
import json

import pytest

from peerd import manifest as mf
from peerd.chunk_fetch import ChunkFetcher, PeerStatus
from peerd.ratelimit import TokenBucket
from tests.fleet import TOKEN, Fleet, call, host_files_match, publish
from weightcast.checkpoint_random import write_random_checkpoint

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def daemon(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"], extra={"x": ["--reserve-bytes", "0"]}).start()
    yield fleet.procs["x"].addr
    fleet.stop()




async def test_requests_without_the_cluster_token_get_401(daemon):
    for method, path in [("GET", "/v1/status"), ("POST", "/v1/gossip"), ("POST", "/v1/jobs")]:
        st, body = await call(method, daemon + path)
        assert st == 401 and "token" in body["error"]
    st, _ = await call("GET", daemon + "/v1/status", headers={"Authorization": "Bearer wrong"})
    assert st == 401


async def test_malformed_and_oversized_bodies(daemon):
    st, body = await call("POST", daemon + "/v1/gossip", data=b"{nope", headers=AUTH)
    assert st == 400 and "JSON" in body["error"]
    st, body = await call("POST", daemon + "/v1/gossip", json={"from": {"id": "../x", "addr": "http://a:1"}},
                          headers=AUTH)
    assert st == 400 and "peer id" in body["error"]
    st, body = await call("POST", daemon + "/v1/gossip", data=b"x" * (2 * 1024 * 1024), headers=AUTH)
    assert st == 413
    st, body = await call("POST", daemon + "/v1/gossip", headers=AUTH, json={
        "from": {"id": "p", "addr": "http://127.0.0.1:1"}, "versions": {"a" * 64: "!!notbase64"}})
    assert st == 200        # a bad bitmap for an unknown version is ignored, not fatal
    for load in ("half", -1, True):
        st, body = await call("POST", daemon + "/v1/gossip", headers=AUTH, json={
            "from": {"id": "p", "addr": "http://127.0.0.1:1"}, "load": load})
        assert st == 400 and "load" in body["error"]
    st, body = await call("POST", daemon + "/v1/gossip", headers=AUTH, json={
        "from": {"id": "p", "addr": "http://127.0.0.1:1"}, "load": 0.5})
    assert st == 200 and body["load"] == 0.0     # and the reply carries this daemon's own (idle)
    st, body = await call("POST", daemon + "/v1/jobs", json={"manifest": "x"}, headers=AUTH)
    assert st == 400 and "manifest" in body["error"]
    st, body = await call("GET", daemon + "/v1/jobs/not-a-version", headers=AUTH)
    assert st == 400
    st, body = await call("GET", daemon + "/v1/versions/" + "0" * 64 + "/chunks/0", headers=AUTH)
    assert st == 404
    st, body = await call("GET", daemon + "/healthz")
    assert st == 200 and body["ok"]


async def test_bad_manifests_are_refused_with_reasons(daemon, signed, keys):
    m, doc = signed
    tampered = json.loads(json.dumps(doc))
    tampered["manifest"]["files"][0]["size"] += 1
    st, body = await call("POST", daemon + "/v1/jobs", json={"manifest": tampered}, headers=AUTH)
    assert st == 422 and "declares" in body["error"]
    resigned = json.loads(json.dumps(doc))
    resigned["manifest"]["version"] = "v9"
    st, body = await call("POST", daemon + "/v1/jobs", json={"manifest": resigned}, headers=AUTH)
    assert st == 422 and "bad signature" in body["error"]
    body_ = m.body()
    body_["files"][0]["path"] = "../../etc/evil"
    for c in body_["chunks"]:
        if c["file"] == m.files[0].path:
            c["file"] = "../../etc/evil"
    st, body = await call("POST", daemon + "/v1/jobs", json={"manifest": {"manifest": body_, "signature": doc["signature"]}},
                          headers=AUTH)
    assert st == 422 and "escapes" in body["error"]
    # signed by a trusted key, yet naming the store's own record of what it verified: refused, not 202
    for name in ("verified.json", ".verified.json.1.ab.tmp"):
        renamed = dataclasses.replace(m, files=tuple(dataclasses.replace(f, path=name) if i == 0 else f
                                                     for i, f in enumerate(m.files)),
                                      chunks=tuple(dataclasses.replace(c, file=name) if c.file == m.files[0].path else c
                                                   for c in m.chunks))
        st, body = await call("POST", daemon + "/v1/jobs", json={"manifest": mf.sign_manifest(renamed, keys["private"])},
                              headers=AUTH)
        assert st == 422 and "reserved" in body["error"] and "verified.json" in body["error"], body


async def test_chunk_requests_are_checked(daemon, signed):
    m, doc = signed
    st, _ = await call("POST", daemon + "/v1/jobs", json={"manifest": doc, "origin": None}, headers=AUTH)
    assert st == 202
    base = f"{daemon}/v1/versions/{m.digest}/chunks/"
    assert (await call("GET", base + "999999", headers=AUTH))[0] == 400
    assert (await call("GET", base + "abc", headers=AUTH))[0] == 400
    st, body = await call("GET", base + "0", headers=AUTH)
    assert st == 404 and "not verified" in body["error"]   # never serves what it has not verified


async def test_concurrent_submits_of_one_version_share_one_job(daemon, signed):
    """The version's files are laid out in a worker thread (pre-allocation must not stall the loop):
    submits that arrive meanwhile wait for it and attach to the same job, never lay it out twice."""
    m, doc = signed
    answers = await asyncio.gather(*(call("POST", daemon + "/v1/jobs", json={"manifest": doc, "origin": None},
                                          headers=AUTH) for _ in range(6)))
    assert all(st == 202 for st, _ in answers)
    assert {body["version_id"] for _, body in answers} == {m.digest}
    assert len({body["started"] for _, body in answers}) == 1      # one job object, started once


async def test_disk_full_is_reported_as_such(tmp_path, seaweed, keys, signed):
    m, doc = signed
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["full"],
                  extra={"full": ["--reserve-bytes", str(1 << 60)]}).start()
    try:
        st, body = await call("POST", fleet.procs["full"].addr + "/v1/jobs", json={"manifest": doc}, headers=AUTH)
        assert st == 507 and body["code"] == "disk_full" and "free" in body["error"]
        st, body = await call("GET", fleet.procs["full"].addr + "/healthz")
        assert st == 200
    finally:
        fleet.stop()


async def test_the_chunk_transport_speaks_peerds_api(daemon):
    """peerd's own chunk client against a real daemon: the token is checked and the daemon's 4xx
    messages come through."""
    path = "/v1/versions/" + "0" * 64 + "/chunks/0"
    view = memoryview(bytearray(10))
    wrong = ChunkFetcher({"Authorization": "Bearer wrong"}, TokenBucket(None), stall_after=5)
    with pytest.raises(PeerStatus) as e:
        await wrong.fetch(daemon, path, view)
    assert e.value.status == 401 and "token" in e.value.message
    right = ChunkFetcher(AUTH, TokenBucket(None), stall_after=5)
    with pytest.raises(PeerStatus) as e:
        await right.fetch(daemon, path, view)
    assert e.value.status == 404 and "not stored" in e.value.message
    wrong.close()
    right.close()


async def test_a_stopped_job_counts_every_chunk_its_bitmap_holds(tmp_path, seaweed, keys):
    """Stopped mid-download again and again: each stop's answer counts exactly the chunks whose bitmap
    bytes are on disk, including those whose write was under way when the stop came, and the version
    completes with every chunk fetched once."""
    ckpt = write_random_checkpoint(tmp_path / "ckpt", 24 * 1024 * 1024, files=2, seed=3)
    m = mf.build_from_directory(ckpt, "tiny", "stops", chunk_size=1024 * 1024)
    doc = mf.sign_manifest(m, keys["private"])
    origin = await publish(seaweed, ckpt, "stops")
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"], extra={"x": ["--reserve-bytes", "0"]}).start()
    bitmap = tmp_path / "x" / "store" / "versions" / m.digest / "bitmap"
    try:
        async with fleet.client("x") as c:
            stops, fetched = 0, 0
            while (st := await c.start_job(doc, origin, seeders=["x"]))["state"] != "complete":
                before = st["chunks_done"]
                while (now := await c.job(m.digest))["chunks_done"] == before and now["state"] == "fetching":
                    await asyncio.sleep(0.005)                              # stopped just after a chunk
                st = await c.stop_job(m.digest, "test")
                if st["state"] == "complete":
                    break
                assert st["state"] == "stopped", st
                await asyncio.sleep(0.1)               # a write left running would land by now
                on_disk = bitmap.read_bytes()
                assert st["bytes_done"] == sum(ch.size for ch in m.chunks if on_disk[ch.index]), stops
                assert (await c.job(m.digest))["bytes_done"] == st["bytes_done"]
                fetched += st["bytes_by_source"]["origin"]
                stops += 1
            st = await c.wait(m.digest, 60)
        assert stops >= 3, stops
        assert st["state"] == "complete" and host_files_match(fleet, "x", m, ckpt)
        assert fetched + st["bytes_by_source"]["origin"] == m.total_size       # each chunk fetched once
        assert st["refetched_bytes"] == 0
    finally:
        fleet.stop()
