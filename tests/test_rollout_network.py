"""Partitions during a rollout on a kernel network: every host's peerd, host worker and model server in
a namespace of its own behind a tc-shaped link (lib/netns.py), the origin behind its own, Temporal and
the router reached across the links (Temporal in a namespace of its own, on an unshaped link). A host or rack cut off mid-distribution, for a while or for good,
and a host cut off during the traffic shift. Times to notice are printed, not asserted."""
import asyncio
import subprocess
import time
import uuid

import aiohttp
import pytest

from lib.netns import Topology, existing_namespaces
from tests.rollout_fixtures import Stack
from tests.test_rollout_faults import wait_progress
from weightcast.rollout_status import live_status
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow

RATE = 96 * 1024          # bytes/s each link, each way: the ~0.5 MB checkpoint takes seconds to spread


@pytest.fixture
async def netstack(tmp_path, keys):
    """Hosts a, b in rack 0 and c alone in rack 1."""
    net = Topology([2, 1], host_rate=RATE, origin_rate=RATE, control=True, gateway=True).up()
    s = None
    try:
        s = await Stack().start(tmp_path, None, keys, ["a", "b", "c"], net=net)
        yield s, net
    finally:
        if s is not None:
            net.heal()                                   # processes cut off would wait out their timeouts
            await s.stop()
        net.down()
    assert not [n for n in existing_namespaces() if n.startswith(net.tag)]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert f"{net.tag}-gw" not in links                  # the gateway's end here went with the fabric


async def received(s: Stack, host: str) -> dict[str, int]:
    """Bytes ``host``'s peerd received over its life, every job included (a job posted again after a
    partition counts only its own): all of them, the second copies among them (a request given up in
    the partition whose answer came after all, endgame), and those of chunks asked for again after they
    were verified."""
    async with aiohttp.ClientSession() as http, http.get(f"{s.stack.peerd[host].addr}/metrics") as r:
        text = await r.text()
    out = {}
    for name in ("download", "duplicate", "refetched"):
        out[name] = int(sum(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith((f"peerd_{name}_bytes_total{{", f"peerd_{name}_bytes_total "))))
    return out


async def noticed(s: Stack, wid: str, host: str, t0: float, timeout: float = 30) -> float:
    """Seconds from ``t0`` until `weightcast rollout status` names ``host`` stuck, with the reason."""
    while time.monotonic() - t0 < timeout:
        st = await live_status(s.client, wid)
        if host in st["stuck"]:
            assert any(why in st["stuck"][host] for why in ("no heartbeat", "Heartbeat timeout", "not picked up")), \
                st["stuck"]
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise TimeoutError(f"status never showed {host} stuck")


async def test_a_partitioned_rack_rejoins_then_a_host_cut_off_during_the_shift_gets_no_requests(netstack):
    """Rack 1 (host c) is cut from the spine mid-distribution for 6 s: the rollout waits, c rejoins and
    fetches nothing twice. Then c's cable is pulled while traffic moves: the router stops routing to it
    and clients keep getting answers from a and b."""
    s, net = netstack
    wid = f"rollout-net-{uuid.uuid4().hex[:6]}"
    handle = await start_rollout(s.client, s.input(heartbeat_timeout_s=3, unreachable_after_s=60,
                                                   traffic_steps=[25, 50, 100], step_wait_s=3), wid)
    await wait_progress(s, "c", at_least=1)
    net.rack_uplink(1, False)
    t0 = time.monotonic()
    print(f"status showed c stuck {await noticed(s, wid, 'c', t0):.1f} s after the partition")
    st = await live_status(s.client, wid)
    assert st["phase"] == "distribute" and st["hosts"]["c"] == "downloading"
    await asyncio.sleep(max(0.0, 6 - (time.monotonic() - t0)))
    net.rack_uplink(1, True)

    for _ in range(900):
        st = await handle.query(RolloutWorkflow.status)
        if st.phase in ("traffic", "done"):
            break
        await asyncio.sleep(0.1)
    assert st.phase == "traffic" and st.hosts == {"a": "ready", "b": "ready", "c": "ready"}
    for h in ("a", "b", "c"):
        got = await received(s, h)
        assert got["download"] - got["duplicate"] == s.m.total_size and got["refetched"] == 0, (h, got)
    net.link(net.hosts[2], False)                        # c's cable pulled while traffic moves
    t0 = time.monotonic()
    admin = {"Authorization": f"Bearer {s.stack.admin_token}"}
    async with aiohttp.ClientSession(headers=admin) as http:
        while True:                                      # the router's poller drops c from the pool
            async with http.get(f"{s.router_addr}/admin/models/tiny") as r:
                ready = (await r.json())["ready"]["v1"]
            if "c" not in ready:
                break
            assert time.monotonic() - t0 < 30, ready
            await asyncio.sleep(0.1)
        print(f"the router stopped routing to c {time.monotonic() - t0:.1f} s after the cut")
        assert sorted(ready) == ["a", "b"]
        routed = []
        for _ in range(20):                              # clients see answers, from a and b only
            async with http.post(f"{s.router_addr}/v1/models/tiny/infer", json={"input_ids": [[1, 2]]}) as r:
                assert r.status == 200, await r.text()
                routed.append((await r.json())["routed_host"])
        assert set(routed) <= {"a", "b"}
    result = await handle.result()
    assert result["ready"] == ["a", "b", "c"] and result["traffic"] == {"v1": 100}


async def test_a_host_cut_off_for_good_is_left_behind_within_the_failure_budget(netstack):
    s, net = netstack
    wid = f"rollout-net-{uuid.uuid4().hex[:6]}"
    handle = await start_rollout(s.client, s.input(heartbeat_timeout_s=2, unreachable_after_s=3,
                                                   failure_budget=0.34), wid)
    await wait_progress(s, "c", at_least=1)
    net.link(net.hosts[2], False)                        # c's cable pulled
    t0 = time.monotonic()
    print(f"status showed c stuck {await noticed(s, wid, 'c', t0):.1f} s after the cut")
    result = await handle.result()
    assert result["ready"] == ["a", "b"] and result["hosts"]["c"] == "unreachable"
    assert "no worker polled host-c" in result["errors"]["c"]
    assert result["traffic"] == {"v1": 100}
    st = await handle.query(RolloutWorkflow.status)
    assert st.hosts["c"] == "unreachable" and st.phase == "done"
    for h in ("a", "b"):
        got = await received(s, h)
        assert got["download"] - got["duplicate"] == s.m.total_size and got["refetched"] == 0, (h, got)
