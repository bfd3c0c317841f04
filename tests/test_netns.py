"""The kernel-network harness (lib/netns.py): namespaces per host and per rack fabric, links shaped by
tc in both directions, partitions by taking links down, and nothing left behind however it ends."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lib.netns import Topology, existing_namespaces, made_here

# a tiny TCP echo: the server answers one line, the client prints what came back or the error
SERVER = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
          "s.bind(('0.0.0.0',9000));s.listen()\nwhile True:\n c,_=s.accept();c.sendall(b'hi\\n');c.close()")
CLIENT = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],9000),timeout=1);print(s.recv(3).decode())"
          "\nexcept OSError as e:\n print(type(e).__name__)")


# UDP: 2000 datagrams sent at 2 per ms (well under the 1 MB/s link); the receiver counts until 1 s of quiet
UDP_SEND = ("import socket,sys,time;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\nfor i in range(2000):\n"
            " s.sendto(b'x'*100,(sys.argv[1],9001))\n if i%2: time.sleep(0.001)")
UDP_COUNT = ("import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind(('0.0.0.0',9001));"
             "s.settimeout(3);n=0\ntry:\n while True:\n  s.recv(200);n+=1;s.settimeout(1)\nexcept OSError:\n pass\nprint(n)")
REPO = Path(__file__).resolve().parent.parent


def reach(src, dst) -> str:
    return subprocess.run(src.run(sys.executable, "-c", CLIENT, dst.addr), capture_output=True, text=True,
                          timeout=30).stdout.strip()


def qdiscs(ns: str) -> dict[str, int]:
    out = json.loads(subprocess.run(["ip", "netns", "exec", ns, "tc", "-j", "qdisc", "show"], capture_output=True,
                                    text=True, check=True).stdout)
    return {q["dev"]: q["options"]["rate"] for q in out if q["kind"] == "tbf"}


def test_racks_links_shaped_both_ways_partitions_and_teardown():
    t = Topology([2, 2], host_rate=2e6, origin_rate=4e6, oversubscription=4).up()
    try:
        h0, h1, h2, h3 = t.hosts
        assert [h.rack for h in t.hosts] == [0, 0, 1, 1] and len({h.addr for h in t.hosts}) == 4
        # every link's both ends shaped: the host's upload, its download (the fabric side), the uplinks
        assert qdiscs(h0.ns) == {"eth0": 2_000_000} and qdiscs(t.origin.ns) == {"eth0": 4_000_000}
        fab = qdiscs(t.fabric)
        assert {fab[f"vh{i}"] for i in range(4)} == {2_000_000} and fab["vo"] == 4_000_000
        assert fab["u0"] == fab["s0"] == fab["u1"] == fab["s1"] == 1_000_000   # 2 hosts x 2 MB/s / 4
        servers = [subprocess.Popen(h.run(sys.executable, "-c", SERVER)) for h in (h1, h2, t.origin)]
        deadline = time.monotonic() + 20
        for server in (h1, h2, t.origin):           # each server starts (refused until it listens)
            while reach(h0, server) != "hi":
                assert time.monotonic() < deadline, f"{server.addr} never answered"
        t.rack_uplink(1, False)                       # rack 1 cut from the spine: h2 out of reach from rack 0
        assert reach(h0, h2) == "TimeoutError" and reach(h3, h2) == "hi"    # rack 1 still talks inside
        assert reach(h0, h1) == "hi" and reach(h0, t.origin) == "hi"
        t.rack_uplink(1, True)
        assert reach(h0, h2) == "hi"
        t.link(h1, False)                             # one host's cable pulled
        assert reach(h0, h1) == "TimeoutError"
        t.link(h1, True)
        assert reach(h0, h1) == "hi"
        assert all(s.poll() is None for s in servers)
    finally:
        t.down()
    # the servers ran inside the namespaces: gone with them, and nothing of the topology is left
    assert all(s.wait(timeout=10) is not None for s in servers)
    assert not [n for n in existing_namespaces() if n.startswith(t.tag)]


@pytest.mark.parametrize("how", ["sigterm", "exception"])
def test_a_harness_that_is_stopped_or_fails_leaves_nothing_behind(tmp_path, how):
    script = ("import sys,time\nfrom lib.netns import Topology\n"
              "t = Topology([2], host_rate=1e6, origin_rate=1e6).up()\nprint(t.tag, flush=True)\n"
              + ("time.sleep(60)\n" if how == "sigterm" else "raise RuntimeError('the benchmark broke')\n"))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tag = p.stdout.readline().strip()
    assert tag.startswith("wc") and any(n.startswith(tag) for n in existing_namespaces())
    if how == "sigterm":
        p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) != 0
    assert not [n for n in existing_namespaces() if n.startswith(tag)]


@pytest.fixture(scope="session")
def nft():
    """nftables' nft, installed by the project's own Makefile target when missing."""
    subprocess.run(["make", "-s", "netns-tools"], cwd=REPO, check=True)


def test_random_loss_is_dropped_by_the_kernel(nft):
    t = Topology([2], host_rate=1e6, origin_rate=1e6, loss=0.25).up()
    try:
        rules = subprocess.run(t.hosts[0].run("nft", "list", "ruleset"), capture_output=True, text=True).stdout
        assert "numgen random mod 1000 < 250 drop" in rules
        # a UDP burst from h0: about a quarter never arrives at h1 (binomial: 2000 packets, 25 % +- 4 %)
        rx = subprocess.Popen(t.hosts[1].run(sys.executable, "-c", UDP_COUNT), stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(t.hosts[0].run(sys.executable, "-c", UDP_SEND, t.hosts[1].addr), check=True)
        got = int(rx.communicate(timeout=30)[0])
        assert 0.71 * 2000 <= got <= 0.79 * 2000, got
    finally:
        t.down()


def test_a_swarm_on_kernel_shaped_links_survives_a_partitioned_rack(capsys, nft):
    """bench swarm --netns through the CLI: 4 hosts in 2 racks, every link shaped by tc, 1 % of packets
    dropped, peerd unpaced; rack 1 is cut from the spine for 2 s mid-run. Every host ends with every
    verified byte, none fetched twice, the origin's one copy; times are reported, not asserted."""
    from weightcast.cli import main
    assert main(["bench", "swarm", "--netns", "--hosts", "4", "--racks", "2", "--size", "12M", "--rate", "4M",
                 "--chunk", "256K", "--partition", "2", "--loss", "0.01", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["netns"] and r["all_verified"] and not r["failed"] and r["refetched_bytes"] == 0
    assert [e["event"] for e in r["faults"]] == ["rack 1 partitioned", "partition healed"]
    assert 0.99 <= r["origin_copies"] < 1.5 and len(r["cross_rack_copies_per_rack"]) == 2
    # 12 MiB at 4 MiB/s: 3 s of wire, 3 x 1514 / 1448 s of TCP payload (MTU 1500, timestamps on)
    assert r["lower_bound_s"] == 3.0 and r["lower_bound_payload_s"] == pytest.approx(3.0 * 1514 / 1448, rel=1e-3)
    assert not made_here()
