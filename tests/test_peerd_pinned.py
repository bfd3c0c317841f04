"""Pinned versions (training checkpoints, docs/trust.md): unsigned manifests a token-holding caller
vouches for, files adopted in place, the rest fetched from peers; a version named only by its id is
fetched with its manifest from a peer and checked against that id. Real peerd processes."""
import json

import aiohttp

from peerd import manifest as mf
from peerd.client import PeerdError
from tests.fleet import TOKEN, Fleet

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def place(fleet: Fleet, host: str, m: mf.Manifest, files: dict[str, bytes]) -> None:
    """What a host worker does before seeding: its own files into the version's directory."""
    model = fleet.root / host / "store" / "versions" / m.digest / "model"
    model.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (model / name).write_bytes(data)


async def test_hosts_adopt_their_own_files_and_swap_the_rest(tmp_path, seaweed, keys):
    src = tmp_path / "ckpt"
    src.mkdir()
    a_bytes, b_bytes = bytes(range(256)) * 300, b"\x07" * 70_000
    (src / "__0_0.distcp").write_bytes(a_bytes)
    (src / "__1_0.distcp").write_bytes(b_bytes)
    m = mf.build_from_directory(src, "train-run", "step-00000010", chunk_size=16 * 1024)
    body = {"manifest": m.body()}
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a", "b", "c", "d"]).start()
    try:
        place(fleet, "a", m, {"__0_0.distcp": a_bytes, "__1_0.distcp": b"\x00" * len(b_bytes)})  # a's copy of b's is wrong
        place(fleet, "b", m, {"__1_0.distcp": b_bytes})
        async with fleet.client("a") as ca, fleet.client("b") as cb, fleet.client("c") as cc:
            # unsigned and not pinned: refused like any unsigned manifest
            try:
                await ca.start_job(body)
                raise AssertionError("an unsigned manifest was accepted without pinned")
            except PeerdError as e:
                assert e.status == 422 and "signature" in e.message
            await ca.start_job(body, pinned=True, adopt=True)
            await cb.start_job(body, pinned=True, adopt=True)
            sa, sb = await ca.wait(m.digest, 30), await cb.wait(m.digest, 30)
            assert sa["state"] == sb["state"] == "complete"
            # each verified its own file in place and fetched the other's; a's wrong bytes were not adopted
            assert sa["bytes_by_source"] == {"local": len(a_bytes), "peer": len(b_bytes), "origin": 0}
            assert sb["bytes_by_source"] == {"local": len(b_bytes), "peer": len(a_bytes), "origin": 0}
            # a host with nothing names the version by id: manifest from a peer (checked against the id), bytes too
            await cc.start_job(None, manifest_ref={"version_id": m.digest}, pinned=True)
            sc = await cc.wait(m.digest, 30)
            assert sc["state"] == "complete" and sc["bytes_by_source"]["peer"] == m.total_size
            model_c = tmp_path / "c" / "store" / "versions" / m.digest / "model"
            assert (model_c / "__0_0.distcp").read_bytes() == a_bytes and (model_c / "__1_0.distcp").read_bytes() == b_bytes
            # a pinned manifest is served marked as pinned: it can never pass as a signed one
            doc = json.loads(await cc.manifest(m.digest))
            assert doc["pinned"] is True and "signature" not in doc
        async with fleet.client("d") as cd:
            # asked for the same version id on the signed path while the origin is unreachable, a host
            # turns to its peers: their manifest is the pinned one, refused there (docs/trust.md)
            origin = {"endpoint": "http://127.0.0.1:9", "bucket": seaweed.bucket, "prefix": "nowhere"}
            try:
                await cd.start_job(None, origin=origin, manifest_ref={"version_id": m.digest,
                                                                      "key": ".weightcast-manifest.json"})
                raise AssertionError("a pinned manifest from a peer passed the signed path")
            except PeerdError as e:
                assert e.status == 502 and "nor from a peer" in e.message
            assert not (tmp_path / "d" / "store" / "versions" / m.digest).exists()
            refusals = [json.loads(line) for line in fleet.procs["d"].log_path.read_text().splitlines()
                        if "manifest from peer failed" in line]
            assert refusals and all("signature" in r["error"] for r in refusals), refusals   # asked, refused
        # restarted, a host serves its pinned versions again
        fleet.procs["b"].stop()
        fleet.procs["b"].start()
        async with fleet.client("b") as cb:
            stored = {e["version_id"]: e for e in (await cb.status())["stored"]}
            assert stored[m.digest]["complete"]
    finally:
        fleet.stop()


async def test_bad_pinned_requests_get_4xx(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["x"]).start()
    url = fleet.procs["x"].addr + "/v1/jobs"
    try:
        async with aiohttp.ClientSession() as s:
            async def post(body):
                async with s.post(url, json=body, headers=AUTH) as r:
                    return r.status, (await r.json())["error"]
            assert (await post({"manifest": {"manifest": {}}, "pinned": "yes"}))[0] == 400
            st, err = await post({"manifest": {"manifest": {"schema": "x"}}, "pinned": True})
            assert st == 422 and "manifest fields" in err
            st, err = await post({"manifest_ref": {"version_id": "not-hex"}, "pinned": True})
            assert st == 400 and "version id" in err
            st, err = await post({"manifest_ref": {"version_id": "a" * 64}})
            assert st == 400 and "manifest_ref" in err          # not pinned: needs a key and an origin
            st, err = await post({"manifest_ref": {"version_id": "a" * 64}, "pinned": True})
            assert st == 502 and "nor from a peer" in err         # nobody holds it: say so, keep running
    finally:
        fleet.stop()
