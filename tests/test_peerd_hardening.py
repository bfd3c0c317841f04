"""Hostile-client probes against a real peerd process: full-size manifests (inline and by reference), and
client input that used to answer 500 or grow state without bound. Each answers 4xx and leaves nothing."""
import asyncio
import json
from urllib.parse import urlparse

import pytest

from peerd import manifest as mf
from peerd.wire import WireError, check_id, check_vid
from tests.fleet import TOKEN, Fleet, call, publish
from tests.waiting import until
from weightcast.checkpoint_random import write_random_checkpoint

AUTH = {"Authorization": f"Bearer {TOKEN}"}
FULL_SIZE_CHUNKS = 6_400       # 400 GB at 64 MiB chunks


@pytest.fixture
def daemon(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"], extra={"x": ["--max-members", "50"]}).start()
    yield fleet
    fleet.stop()




@pytest.fixture
def full_size(tmp_path, keys):
    """A checkpoint cut into as many chunks as 400 GB at 64 MiB (16-byte chunks keep the bytes small)."""
    ckpt = write_random_checkpoint(tmp_path / "big", FULL_SIZE_CHUNKS * 16, files=2, seed=3)
    m = mf.build_from_directory(ckpt, "tiny", "v400", chunk_size=16)
    return ckpt, m, mf.sign_manifest(m, keys["private"])


async def test_full_size_manifest_inline_is_read_whole(daemon, full_size):
    _, m, doc = full_size
    assert len(m.chunks) == FULL_SIZE_CHUNKS and len(json.dumps(doc)) > 1_000_000
    st, body = await call("POST", daemon.procs["x"].addr + "/v1/jobs", json={"manifest": doc}, headers=AUTH)
    assert st == 202, body
    assert body["version_id"] == m.digest and body["chunks_total"] == FULL_SIZE_CHUNKS


async def test_manifest_by_reference_is_fetched_and_checked(daemon, full_size, seaweed):
    ckpt, m, doc = full_size
    origin = await publish(seaweed, ckpt, "by-ref")
    from peerd.origin import OriginSpec, S3Origin
    from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
    async with S3Origin(OriginSpec(seaweed.endpoint, seaweed.bucket, "by-ref"), ACCESS_KEY, SECRET_KEY) as o:
        await o.put_bytes(o.spec.key("signed.json"), json.dumps(doc).encode())
    addr = daemon.procs["x"].addr
    # the wrong id for the bytes at that key: refused, nothing stored
    st, body = await call("POST", addr + "/v1/jobs", headers=AUTH, json={
        "manifest_ref": {"version_id": "0" * 64, "key": "signed.json"}, "origin": origin})
    assert st == 422 and "not the requested" in body["error"]
    st, body = await call("POST", addr + "/v1/jobs", headers=AUTH, json={
        "manifest_ref": {"version_id": m.digest, "key": "missing.json"}, "origin": origin})
    assert st == 422 and "no manifest" in body["error"]
    st, body = await call("GET", addr + "/v1/status", headers=AUTH)
    assert body["stored_versions"] == []
    st, body = await call("POST", addr + "/v1/jobs", headers=AUTH, json={
        "manifest_ref": {"version_id": m.digest, "key": "signed.json"}, "origin": origin, "seeders": ["x"]})
    assert st == 202, body
    async with daemon.client("x") as c:
        # chunks verified against the fetched manifest arrive (all 6,400 through a whole rollout:
        # test_full_size_rollout.py), and peers can take the manifest from here meanwhile
        async def hundred_chunks():
            return (await c.job(m.digest))["chunks_done"] >= 100
        await until(hundred_chunks, 120, "100 chunks from the origin")
        assert json.loads(await c.manifest(m.digest)) == doc
        await c.remove(m.digest)


async def test_deep_json_bad_utf8_tokens_and_odd_numbers_are_4xx(daemon, signed):
    addr = daemon.procs["x"].addr
    for path in ("/v1/gossip", "/v1/jobs"):
        st, body = await call("POST", addr + path, data=b"[" * 100_000, headers=AUTH)
        assert st == 400 and "nested too deeply" in body["error"]
    st, body = await call("POST", addr + "/v1/gossip", data=b'{"x": NaN}', headers=AUTH)
    assert st == 400 and "NaN" in body["error"]
    # an Authorization header that is not UTF-8: 401, not 500
    u = urlparse(addr)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    await writer.drain()
    head = await reader.read(64)
    writer.close()
    assert head.startswith(b"HTTP/1.1 401"), head
    m, doc = signed
    st, body = await call("GET", f"{addr}/v1/versions/{m.digest}/chunks/0.0", headers=AUTH)
    assert st in (400, 404)
    st, _ = await call("GET", addr + "/healthz")
    assert st == 200


async def test_manifests_that_cannot_be_laid_out_are_refused_and_leave_nothing(daemon, keys):
    addr = daemon.procs["x"].addr
    digest = "ab" * 32

    def doc_with(files, chunks):
        body = {"schema": mf.SCHEMA, "model": "tiny", "version": "v1", "created_at": "t", "hash_algorithm": "sha256",
                "chunk_size": 4, "files": files, "chunks": chunks}
        return body

    cases = {
        "both a file and a directory": ([{"path": "a", "size": 4, "digest": digest},
                                         {"path": "a/b/c", "size": 4, "digest": digest}],
                                        [{"index": 0, "file": "a", "offset": 0, "size": 4, "digest": digest},
                                         {"index": 1, "file": "a/b/c", "offset": 0, "size": 4, "digest": digest}]),
        "component over 255 bytes": ([{"path": "d/" + "n" * 300, "size": 4, "digest": digest}],
                                     [{"index": 0, "file": "d/" + "n" * 300, "offset": 0, "size": 4, "digest": digest}]),
        "indices must be": ([{"path": "f", "size": 4, "digest": digest}],
                            [{"index": 0.0, "file": "f", "offset": 0, "size": 4, "digest": digest}]),
    }
    from peerd.signing import public_key_id, sign
    for want, (files, chunks) in cases.items():
        body = doc_with(files, chunks)
        signed = {"manifest": body, "signature": {"key_id": public_key_id(keys["public"]),
                                                  "sig": sign(keys["private"], mf.canonical_json(body))}}
        st, out = await call("POST", addr + "/v1/jobs", json={"manifest": signed}, headers=AUTH)
        assert st == 422 and want in out["error"], (want, out)
    versions = daemon.root / "x" / "store" / "versions"
    assert list(versions.iterdir()) == []


async def test_gossip_cannot_grow_membership_without_bound(daemon):
    addr = daemon.procs["x"].addr
    for k in range(10):
        peers = [{"id": f"p{k}-{j}", "addr": f"http://127.0.0.1:{1000 + j}", "rack": ""} for j in range(256)]
        st, _ = await call("POST", addr + "/v1/gossip", headers=AUTH, json={
            "from": {"id": f"sender{k}", "addr": "http://127.0.0.1:9", "rack": ""}, "peers": peers})
        assert st == 200
    st, body = await call("GET", addr + "/v1/status", headers=AUTH)
    assert len(body["members"]) <= 50


async def test_names_are_matched_in_full():
    for bad in ("v1\n", "a" * 64 + "\n"):
        with pytest.raises(WireError):
            check_vid(bad)
    with pytest.raises(WireError):
        check_id("host\n")
    with pytest.raises(mf.ManifestError):
        mf.safe_relative_path("ok/\x01name")


async def test_connections_that_never_finish_their_headers_or_bodies_are_closed(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["s"],
                  extra={"s": ["--header-timeout", "1", "--body-timeout", "2", "--max-connections", "20"]}).start()
    u = urlparse(fleet.procs["s"].addr)
    try:
        slow = []
        for _ in range(40):                       # more silent connections than the cap
            r, w = await asyncio.open_connection(u.hostname, u.port)
            w.write(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")     # a head that never ends
            await w.drain()
            slow.append((r, w))
        st, body = await call("GET", fleet.procs["s"].addr + "/healthz")      # real clients still served
        assert st == 200
        closed = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in slow)), timeout=10)
        assert all(data == b"" for data in closed)   # every one closed by the server (EOF, no answer)
        for _, w in slow:
            w.close()

        # a whole head, then a body trickled a byte at a time: closed once its 2 s body deadline passes
        async def trickle(w):
            while True:
                w.write(b" ")
                await w.drain()
                await asyncio.sleep(0.3)
        trickling = []
        for _ in range(5):
            r, w = await asyncio.open_connection(u.hostname, u.port)
            w.write(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
            trickling.append((r, w, asyncio.create_task(trickle(w))))
        try:
            ended = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _, _ in trickling)), timeout=10)
            assert all(not data.startswith(b"HTTP/1.1 2") for data in ended)     # never accepted, never kept
        finally:
            for _, w, t in trickling:
                t.cancel()
                w.close()
        st, body = await call("GET", fleet.procs["s"].addr + "/healthz")
        assert st == 200
    finally:
        fleet.stop()
