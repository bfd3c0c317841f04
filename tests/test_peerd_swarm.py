"""Real peerd processes on loopback with the origin in SeaweedFS: the swarm and its faults."""
import asyncio
import json
import os
import signal
import uuid

import aiohttp
import pytest

from tests.fleet import Fleet, host_files_match, publish, wait_all


RATE = 8 * 1024 * 1024   # slow enough that faults land mid-transfer


@pytest.fixture
def prefix():
    return f"t/{uuid.uuid4().hex[:8]}"


async def swarm_of_four(tmp_path, seaweed, keys, doc, checkpoint, prefix):
    """Four rate-limited hosts, all seeders, each told to fetch; returns (fleet, ids, origin)."""
    origin = await publish(seaweed, checkpoint, prefix)
    ids = ["a", "b", "c", "d"]
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ids, rate=RATE).start()
    await asyncio.sleep(0.5)   # let gossip introduce everyone
    for i in ids:
        async with fleet.client(i) as c:
            st = await c.start_job(doc, origin, seeders=ids)
            assert st["state"] in ("fetching", "complete")
    return fleet, ids, origin


async def test_swarm_completes_verified_with_one_origin_copy(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    m, doc = signed
    fleet, ids, origin = await swarm_of_four(tmp_path, seaweed, keys, doc, checkpoint, prefix)
    try:
        done = await wait_all(fleet, ids, m.digest)
        assert all(s["state"] == "complete" for s in done.values())
        assert all(host_files_match(fleet, i, m, checkpoint) for i in ids)
        # the hand-off to the model server: a fingerprint of every verified file
        vj = json.loads((tmp_path / "a" / "store" / "versions" / m.digest / "model" / "verified.json").read_text())
        assert vj["version"] == "v1" and set(vj["files"]) == {f.path for f in m.files}
        origin_bytes = sum(s["bytes_by_source"]["origin"] for s in done.values())
        assert origin_bytes <= 1.1 * m.total_size            # striped: about one copy from the origin
        assert sum(s["bytes_by_source"]["peer"] for s in done.values()) >= 2 * m.total_size
        async with fleet.client("a") as c:                    # idempotent: a second submit attaches
            again = await c.start_job(doc, origin, seeders=ids)
            assert again["state"] == "complete"
        async with aiohttp.ClientSession() as s:
            async with s.get(fleet.procs["a"].addr + "/metrics") as r:
                text = await r.text()
        assert "peerd_chunks_verified_total" in text and "peerd_upload_bytes_total" in text
    finally:
        fleet.stop()


async def test_killed_peer_mid_transfer(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    """One host is SIGKILLed mid-transfer: the rest finish, verified; its stripe moves to the living."""
    m, doc = signed
    fleet, ids, origin = await swarm_of_four(tmp_path, seaweed, keys, doc, checkpoint, prefix)
    try:
        async with fleet.client("d") as c:
            while (await c.job(m.digest))["chunks_done"] < 2:
                await asyncio.sleep(0.02)
        fleet.procs["d"].kill()
        done = await wait_all(fleet, ["a", "b", "c"], m.digest)
        assert all(s["state"] == "complete" for s in done.values())
        assert all(host_files_match(fleet, i, m, checkpoint) for i in ["a", "b", "c"])
    finally:
        fleet.stop()


async def test_corrupt_peer_is_quarantined_and_its_bytes_never_kept(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    """'late' can only fetch from an honest peer and one that flips a byte in everything it serves
    (the origin is unreachable for it): it finishes from the honest one, verified, and quarantines
    the other."""
    m, doc = signed
    origin = await publish(seaweed, checkpoint, prefix)
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a", "bad", "late"], corrupt={"bad"}).start()
    try:
        for i in ("a", "bad"):
            async with fleet.client(i) as c:
                await c.start_job(doc, origin, seeders=["a"])
                assert (await c.wait(m.digest, 60))["state"] == "complete"
        async with fleet.client("late") as c:
            await c.start_job(doc, {**origin, "endpoint": "http://127.0.0.1:9"}, seeders=["late"])
            st = await c.wait(m.digest, 60)
            assert (await c.status())["quarantined"].keys() == {"bad"}
        assert st["state"] == "complete" and host_files_match(fleet, "late", m, checkpoint)
    finally:
        fleet.stop()


async def test_restart_resumes_without_refetching_verified_chunks(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    m, doc = signed
    origin = await publish(seaweed, checkpoint, prefix)
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["solo"], rate=RATE).start()
    try:
        async with fleet.client("solo") as c:
            await c.start_job(doc, origin, seeders=["solo"])
            while (await c.job(m.digest))["chunks_done"] < 4:
                await asyncio.sleep(0.02)
        fleet.procs["solo"].kill()
        bitmap = (tmp_path / "solo" / "store" / "versions" / m.digest / "bitmap").read_bytes()
        kept = sum(c.size for c in m.chunks if bitmap[c.index])
        assert 0 < kept < m.total_size
        fleet.start(["solo"])
        async with fleet.client("solo") as c:
            await c.start_job(doc, origin, seeders=["solo"])
            st = await c.wait(m.digest, 60)
        assert st["state"] == "complete"
        assert st["bytes_by_source"]["origin"] == m.total_size - kept   # nothing verified fetched again
        assert host_files_match(fleet, "solo", m, checkpoint)
    finally:
        fleet.stop()


async def test_origin_unreachable_but_peers_have_it(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    m, doc = signed
    origin = await publish(seaweed, checkpoint, prefix)
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a", "late"]).start()
    try:
        async with fleet.client("a") as c:
            await c.start_job(doc, origin, seeders=["a"])
            assert (await c.wait(m.digest, 60))["state"] == "complete"
        dead_origin = {**origin, "endpoint": "http://127.0.0.1:9"}   # nothing listens there
        async with fleet.client("late") as c:
            await c.start_job(doc, dead_origin, seeders=["late"])
            st = await c.wait(m.digest, 60)
        assert st["state"] == "complete" and st["bytes_by_source"]["origin"] == 0
        assert host_files_match(fleet, "late", m, checkpoint)
    finally:
        fleet.stop()


async def one_host_holding(tmp_path, seaweed, keys, doc, digest, checkpoint, prefix):
    """Host "a" alone, with the version fetched from the origin and complete; returns (fleet, origin)."""
    origin = await publish(seaweed, checkpoint, prefix)
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a"]).start()
    async with fleet.client("a") as c:
        await c.start_job(doc, origin, seeders=["a"])
        assert (await c.wait(digest, 60))["state"] == "complete"
    return fleet, origin


async def test_delta_rollout_copies_unchanged_chunks_locally(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    from peerd import manifest as mf
    m, doc = signed
    fleet, _ = await one_host_holding(tmp_path, seaweed, keys, doc, m.digest, checkpoint, prefix)
    try:
        changed = checkpoint / m.files[0].path
        data = bytearray(changed.read_bytes())
        data[0] ^= 0xFF
        changed.write_bytes(bytes(data))
        m2 = mf.build_from_directory(checkpoint, "tiny", "v2", chunk_size=m.chunk_size)
        origin2 = await publish(seaweed, checkpoint, prefix + "-v2")
        async with fleet.client("a") as c:
            await c.start_job(mf.sign_manifest(m2, keys["private"]), origin2, seeders=["a"])
            st = await c.wait(m2.digest, 60)
        assert st["state"] == "complete"
        assert st["bytes_by_source"]["origin"] == m2.chunks[0].size     # only the changed chunk
        assert st["bytes_by_source"]["local"] == m2.total_size - m2.chunks[0].size
    finally:
        fleet.stop()


async def test_bytes_changed_on_disk_after_verification_are_not_served(tmp_path, seaweed, keys, signed, checkpoint,
                                                                       prefix):
    """A byte flipped in a verified file with its mtime put back (`touch -r`): peerd notices before the
    chunk leaves the host, stops serving it, fails the job, and a re-submit fetches just that chunk."""
    import os
    m, doc = signed
    fleet, origin = await one_host_holding(tmp_path, seaweed, keys, doc, m.digest, checkpoint, prefix)
    try:
        async with fleet.client("a") as c:
            victim = m.chunks[1]
            path = tmp_path / "a" / "store" / "versions" / m.digest / "model" / victim.file
            st = path.stat()
            with open(path, "r+b") as f:
                f.seek(victim.offset + 7)
                b = f.read(1)
                f.seek(victim.offset + 7)
                f.write(bytes([b[0] ^ 0xFF]))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            url = f"{fleet.procs['a'].addr}/v1/versions/{m.digest}/chunks/"
            async with aiohttp.ClientSession(headers=c.headers) as s:
                async with s.get(url + str(victim.index)) as r:
                    assert r.status == 404 and "changed on disk" in (await r.json())["error"]
                other = next(x for x in m.chunks if x.file != victim.file)
                async with s.get(url + str(other.index)) as r:
                    assert r.status == 200 and len(await r.read()) == other.size
            job = await c.job(m.digest)
            assert job["state"] == "failed" and job["error"]["code"] == "corrupt_on_disk"
            assert not (path.parent / "verified.json").exists()
            await c.start_job(doc, origin, seeders=["a"])      # the rollout's retry
            again = await c.wait(m.digest, 60)
            assert again["state"] == "complete" and again["bytes_by_source"]["origin"] == victim.size
        assert host_files_match(fleet, "a", m, checkpoint)
    finally:
        fleet.stop()


@pytest.mark.parametrize("transport", ["have-links", "http"])
async def test_each_verified_chunk_is_pushed_to_the_swarm_as_news(tmp_path, seaweed, keys, signed, checkpoint, prefix,
                                                                  transport):
    """Refreshes and gossip rounds 30 s apart: 'b' (no origin access) still fetches from 'a' while 'a'
    is reading the origin, because each chunk 'a' verifies is pushed to its active peers within
    --have-interval, over HAVE links (news frames) or, with --no-have-stream, HTTP POSTs. Without that
    push 'b' would learn of a's chunks only when 'a' finished."""
    m, doc = signed
    origin = await publish(seaweed, checkpoint, prefix)
    quiet = ["--have-refresh", "30", "--gossip-interval", "30", "--dead-after", "60"] + \
        (["--no-have-stream"] if transport == "http" else [])
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a", "b"],
                  extra={"a": quiet + ["--origin-rate", "1M"], "b": quiet}).start()
    try:
        async with fleet.client("a") as ca, fleet.client("b") as cb:
            await ca.start_job(doc, origin, seeders=["a"])
            await cb.start_job(doc, origin, seeders=["a"])
            fetched_early = 0
            while (await ca.job(m.digest))["state"] == "fetching":
                fetched_early = max(fetched_early, (await cb.job(m.digest))["chunks_done"])
                await asyncio.sleep(0.05)
            assert fetched_early >= len(m.chunks) // 2, fetched_early   # most of it, while 'a' was still reading
            frames = await ca.metric('peerd_have_frames_total{direction="sent"}')
            assert (frames >= len(m.chunks) // 2) if transport == "have-links" else frames == 0, frames
            done = await cb.wait(m.digest, 30)
        assert done["state"] == "complete" and done["bytes_by_source"]["origin"] == 0
        assert host_files_match(fleet, "b", m, checkpoint)
    finally:
        fleet.stop()


async def test_a_silent_uploader_is_given_up_after_stall_after(tmp_path, seaweed, keys, signed, checkpoint, prefix):
    """'a' (paced uploads: a chunk takes it 2 s) freezes (SIGSTOP: no RST, no bytes, its host looks
    alive for dead_after = 60 s) while 'c' has requests in flight to it: 'c' gives them up after
    --stall-after 1 s and fetches them from 'b', finishing while 'a' is frozen and still believed alive."""
    m, doc = signed
    origin = await publish(seaweed, checkpoint, prefix)
    slow_c = ["--download-rate", "512K", "--stall-after", "1", "--dead-after", "60"]
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a", "b", "c"],
                  extra={"a": ["--dead-after", "60", "--upload-rate", "128K"], "b": ["--dead-after", "60"],
                         "c": slow_c}).start()
    try:
        for i in ("b", "a"):                          # 'b' from the origin, then 'a' from 'b'
            async with fleet.client(i) as cl:
                await cl.start_job(doc, origin, seeders=[i])
            await wait_all(fleet, [i], m.digest)
        async with fleet.client("c") as cc:
            await cc.start_job(doc, origin, seeders=[])
            while True:                               # until 'c' is mid-download with a request to 'a'
                st = await cc.job(m.digest)
                if any(p["peer"] == "a" and p["inflight"] for p in st["peers"]) and st["chunks_done"] >= 1:
                    break
                assert st["state"] == "fetching", st
                await asyncio.sleep(0.01)
            os.kill(fleet.procs["a"].proc.pid, signal.SIGSTOP)
            try:
                done = await cc.wait(m.digest, 20)    # ~3x the ~6 s it takes; well under dead_after (60 s)
                assert done["state"] == "complete"
                assert [p["alive"] for p in done["peers"] if p["peer"] == "a"] == [True]   # never called dead
            finally:
                os.kill(fleet.procs["a"].proc.pid, signal.SIGCONT)
        # the requests to 'a' ended as read timeouts (errors), not as endgame cancels
        async with aiohttp.ClientSession() as s:
            async with s.get(fleet.procs["c"].addr + "/metrics") as r:
                metrics = await r.text()
        errors = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('peerd_chunk_failures_total{reason="error"}')]
        assert errors and errors[0] >= 1, metrics
        assert host_files_match(fleet, "c", m, checkpoint)
    finally:
        fleet.stop()
