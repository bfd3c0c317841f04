"""A chunk whose fetch the policy cancelled (its peer declared dead) while the chunk was being hashed
and written: once the store marks it verified, the policy must already count it held. Otherwise, for
the turn of the event loop before it hears, the policy counts the chunk missing and not in flight, and
its next requests may ask for a chunk this host already has (a refetch, seen on the kernel-network
swarm with a partitioned rack)."""
import threading

from peerd import manifest as mf
from peerd.config import PeerdConfig
from peerd.daemon import Daemon
from peerd.store import ChunkStore, VersionStore
from tests.waiting import until
from weightcast.checkpoint_random import write_random_checkpoint


async def test_a_chunk_written_after_its_fetch_was_cancelled_is_held_by_the_policy_when_its_bit_is_set(
        tmp_path, keys, monkeypatch):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", 512 * 1024, files=1, seed=3)
    m = mf.build_from_directory(ckpt, "tiny", "v1", chunk_size=64 * 1024)
    signed = mf.sign_manifest(m, keys["private"])
    seeded = ChunkStore(tmp_path / "a").open_version(m, mf.signed_bytes(m, keys["private"]))
    seeded.import_files(ckpt)                   # host a holds the whole version
    seeded.write_verified()
    seeded.close()

    release, writing = threading.Event(), threading.Event()
    write_chunk, mark_verified = VersionStore.write_chunk, VersionStore.mark_verified
    unheld: list[int] = []
    jobs: dict = {}

    def held_write(self, index, data):          # the hash and write, in a worker thread, held open
        writing.set()
        release.wait(30)
        return write_chunk(self, index, data)

    def checked_mark(self, index):
        job = jobs.get("b")
        if job is not None and not (job.policy.have[index] or job.policy.inflight_mask[index]):
            unheld.append(index)                # verified here, yet the policy could ask for it again
        return mark_verified(self, index)

    monkeypatch.setattr(VersionStore, "write_chunk", held_write)
    monkeypatch.setattr(VersionStore, "mark_verified", checked_mark)
    a = Daemon(PeerdConfig(host_id="a", store=tmp_path / "a", port=0, trusted_keys=[keys["pub_path"]]))
    b = Daemon(PeerdConfig(host_id="b", store=tmp_path / "b", port=0, trusted_keys=[keys["pub_path"]]))
    await a.start()
    await b.start()
    try:
        job = jobs["b"] = await b.submit({"manifest": signed, "origin": None, "seeders": [], "adopt": False,
                                          "pinned": False, "peers": [{"id": "a", "addr": a.addr, "rack": ""}]})
        await until(lambda: writing.is_set(), 30, "a chunk from a being written on b")
        job.on_peer_dead("a")                   # the policy cancels every request to a: their chunks missing
        release.set()
        await until(lambda: job.vs.done_chunks > 0 and not job._commits, 30, "the written chunks committed")
        assert job.vs.done_chunks > 0 and unheld == []
        assert job.refetched_bytes == 0
    finally:
        release.set()
        await b.stop()
        await a.stop()
