"""Properties of a real peerd under generated input: any Range on a chunk GET answers exactly the bytes
HTTP's byte-range rules name, or a 416; no run of gossip grows membership past --max-members."""
import json
import random
import re

from hypothesis import given, strategies as st

from peerd import manifest as mf
from tests.fleet import TOKEN, Fleet, publish
from tests.http_probe import SETTINGS, request
from weightcast.checkpoint_random import write_random_checkpoint

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 4096
MAX_MEMBERS = 40
RANGE = st.one_of(
    st.tuples(st.integers(0, 2 * CHUNK), st.integers(0, 2 * CHUNK)).map(lambda ab: f"bytes={ab[0]}-{ab[1]}"),
    st.integers(0, 2 * CHUNK).map(lambda a: f"bytes={a}-"),                 # open-ended
    st.integers(1, 2 * CHUNK).map(lambda n: f"bytes=-{n}"),                 # suffix form: not supported
    st.sampled_from(["bytes=0-1,4-5", "items=0-1", "bytes=a-b", "bytes=" + "9" * 16 + "-", "", "bytes=-"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=20))


def expected(rng: str, size: int) -> tuple[int, int] | None:
    """(start, end) inclusive as peerd's contract has it (docs/peerd.md), or None for a 416."""
    m = re.fullmatch(r"bytes=([0-9]{1,15})-([0-9]{0,15})", rng)
    if not m:
        return None
    start = int(m.group(1))
    end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
    return (start, end) if start <= end else None


async def test_chunk_ranges_answer_exactly_the_named_bytes_or_416(tmp_path, seaweed, keys):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", 6 * CHUNK + 100, files=2, seed=11)
    m = mf.build_from_directory(ckpt, "tiny", "vr", chunk_size=CHUNK)
    origin = await publish(seaweed, ckpt, "ranges")
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["r"]).start()
    try:
        async with fleet.client("r") as c:
            await c.start_job(mf.sign_manifest(m, keys["private"]), origin, ["r"])
            assert (await c.wait(m.digest, 60))["state"] == "complete"
        addr = fleet.procs["r"].addr
        chunks = [(ch, (ckpt / ch.file).read_bytes()[ch.offset:ch.offset + ch.size]) for ch in m.chunks]

        @SETTINGS
        @given(st.sampled_from(range(len(chunks))), RANGE)
        def probe(i, rng):
            ch, data = chunks[i]
            status, body, headers = request(addr, "GET", f"/v1/versions/{m.digest}/chunks/{ch.index}",
                                            headers={**AUTH, "Range": rng})
            sent = rng.strip(" \t")             # HTTP strips a header value's surrounding whitespace
            want = expected(sent, ch.size) if sent else (0, ch.size - 1)
            if want is None:
                assert status == 416, (rng, status)
            else:
                start, end = want
                assert status == (206 if sent else 200) and body == data[start:end + 1], (rng, status, len(body))
                if sent:
                    assert headers["Content-Range"] == f"bytes {start}-{end}/{ch.size}"
        probe()
    finally:
        fleet.stop()


def test_gossip_never_grows_membership_past_max_members(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["g"], extra={"g": ["--max-members", str(MAX_MEMBERS)]}).start()
    addr = fleet.procs["g"].addr
    sent = set()
    try:
        @SETTINGS
        @given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 256)), min_size=1, max_size=6))
        def probe(rounds):
            for seed, n in rounds:          # each round: a sender and up to 256 peers, some seen before
                rnd = random.Random(seed)
                peers = [{"id": f"p{rnd.randrange(3000)}", "rack": f"r{rnd.randrange(8)}",
                          "addr": f"http://10.9.{rnd.randrange(250)}.{rnd.randrange(250)}:7700"} for _ in range(n)]
                sent.update(p["id"] for p in peers)
                body = json.dumps({"from": peers[0], "versions": {}, "peers": peers[1:]}).encode()
                assert request(addr, "POST", "/v1/gossip", body, {**AUTH, "Content-Type": "application/json"})[0] < 300
                status, raw, _ = request(addr, "GET", "/v1/status", headers=AUTH)
                members = json.loads(raw)["members"]
                assert status == 200 and len(members) <= MAX_MEMBERS, len(members)
        probe()
        assert len(sent) > 5 * MAX_MEMBERS          # far more were offered than it may keep
        assert request(addr, "GET", "/healthz")[0] == 200
    finally:
        fleet.stop()
