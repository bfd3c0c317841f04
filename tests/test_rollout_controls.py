"""On-call controls that act within seconds, against the real dev server, host worker processes and
peerd: pause stops every download mid-distribution and resume continues from the bitmaps; abort stops
the downloads, removes the aborted version from every store and closes the workflow; an abort during
a traffic step's dwell does not wait for the dwell to end."""
import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.worker import Replayer

from peerd.client import PeerdClient, PeerdError
from tests.rollout_fixtures import Stack
from tests.test_rollout_faults import RATE, fetched, job, rollout_mid_distribution, wait_progress
from weightcast.rollout_status import live_status
from weightcast.rollouts import start_rollout
from workers.control_worker import WORKFLOWS
from workflows.rollout import RolloutWorkflow

pytestmark = pytest.mark.asyncio
ACT_WITHIN_S = 5.0


async def until(predicate, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every)
    raise TimeoutError(f"not within {timeout} s: {what}")


async def replays(handle) -> None:
    """The history just made (pause, cancelled children, resume; abort and discard) replays against
    this code; WEIGHTCAST_RECORD_HISTORIES=1 keeps it as a golden history (named by workflow id)."""
    hist = await handle.fetch_history()
    result = await Replayer(workflows=WORKFLOWS).replay_workflow(hist, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
    if os.environ.get("WEIGHTCAST_RECORD_HISTORIES"):
        (Path(__file__).parent / "histories" / f"{handle.id}.json").write_text(hist.to_json())


async def stored(s: Stack, host: str) -> list[str]:
    async with PeerdClient(s.stack.peerd[host].addr, s.stack.token) as c:
        return (await c.status())["stored_versions"]


async def test_pause_stops_every_download_within_seconds_and_resume_continues_from_the_bitmaps(
        tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE)
    try:
        _, handle = await rollout_mid_distribution(s, "rollout-tiny-v1-paused")
        t0 = time.monotonic()
        await handle.signal(RolloutWorkflow.pause)

        async def both_stopped():
            states = [(await job(s, h) or {}).get("state") for h in ("a", "b")]
            return all(st == "stopped" for st in states)
        await until(both_stopped, ACT_WITHIN_S, "both downloads stopped after pause")
        stop_s = time.monotonic() - t0
        frozen = [(await job(s, h))["chunks_done"] for h in ("a", "b")]
        await asyncio.sleep(1.0)
        assert [(await job(s, h))["chunks_done"] for h in ("a", "b")] == frozen     # nothing moves while paused
        st = await handle.query(RolloutWorkflow.status)
        assert st.paused and set(st.hosts.values()) == {"paused"} and st.phase == "distribute"

        kept = {}
        for h in ("a", "b"):
            bitmap = (s.stack.peerd[h].store / "versions" / s.m.digest / "bitmap").read_bytes()
            kept[h] = sum(c.size for c in s.m.chunks if bitmap[c.index])
        assert 0 < kept["a"] < s.m.total_size
        await handle.signal(RolloutWorkflow.resume)
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}
        for h in ("a", "b"):
            st = await job(s, h)
            assert st["state"] == "complete" and fetched(st) == s.m.total_size - kept[h]   # nothing twice
        await replays(handle)
        print(f"pause: downloads stopped {stop_s:.2f} s after the signal")
    finally:
        await s.stop()


async def test_abort_mid_distribution_stops_downloads_and_removes_the_version_within_seconds(
        tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE)
    try:
        _, handle = await rollout_mid_distribution(s, "rollout-tiny-v1-aborted")
        assert s.m.digest in await stored(s, "a")
        t0 = time.monotonic()
        assert "aborting" in await handle.execute_update(RolloutWorkflow.abort, "on-call: wrong checkpoint")
        with pytest.raises(WorkflowFailureError) as e:
            await handle.result()
        closed_s = time.monotonic() - t0
        assert "aborted: on-call: wrong checkpoint" in str(e.value.cause)
        assert closed_s < ACT_WITHIN_S, closed_s
        for h in ("a", "b"):
            assert s.m.digest not in await stored(s, h)                 # gone from every store
            assert not (s.stack.peerd[h].store / "versions" / s.m.digest).exists()
            with pytest.raises(PeerdError):                              # and its job with it
                async with PeerdClient(s.stack.peerd[h].addr, s.stack.token) as c:
                    await c.job(s.m.digest)
        st = await handle.query(RolloutWorkflow.status)
        assert st.phase == "failed" and set(st.hosts.values()) == {"discarded"}
        await replays(handle)
        print(f"abort: workflow closed and version removed {closed_s:.2f} s after the update")
    finally:
        await s.stop()


async def test_abort_during_a_traffic_dwell_does_not_wait_for_it(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"])
    try:
        inp = s.input(traffic_steps=[10, 100])
        inp.step_wait_s = 300                      # an hour-long bake would look the same
        handle = await start_rollout(s.client, inp, f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        async def at_ten_percent():
            st = await handle.query(RolloutWorkflow.status)
            return st.traffic == {"v1": 10}
        await until(at_ten_percent, 60, "the first traffic step")
        t0 = time.monotonic()
        await handle.execute_update(RolloutWorkflow.abort, "on-call: latency regression")
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert time.monotonic() - t0 < ACT_WITHIN_S
        # no previous version to return to: v1 still serves its 10 %, so it is left loaded and stored
        assert s.stack.router.table.models["tiny"].weights.get("v1") == 10
        assert ("tiny", "v1") in s.servers["a"].versions and s.m.digest in await stored(s, "a")
    finally:
        await s.stop()


@pytest.mark.parametrize("victim", ["host worker", "peerd"])
async def test_status_shows_live_bytes_in_seconds_and_a_silent_host_as_stuck_within_10_s(
        tmp_path, seaweed, keys, victim):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE)
    try:
        wid = f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}"
        handle = await start_rollout(s.client, s.input(), wid)
        await wait_progress(s, "a", at_least=1)
        t0 = time.monotonic()

        async def live_bytes():
            st = await live_status(s.client, wid)
            return st["progress"].get("a", {}).get("bytes_done", 0) > 0 and st
        await until(live_bytes, 3.0, "live bytes for host a in `rollout status`")
        live_s = time.monotonic() - t0

        proc = s.stack.host_workers["a"] if victim == "host worker" else s.stack.peerd["a"]
        proc.kill()
        t1 = time.monotonic()

        async def a_stuck():
            st = await live_status(s.client, wid)
            return "a" in st["stuck"] and st
        st = await until(a_stuck, 10.0, f"host a shown stuck after its {victim} was killed", every=0.25)
        stuck_s = time.monotonic() - t1
        assert "b" not in st["stuck"]
        assert st["progress"]["a"]["heartbeat_age_s"] >= 6
        print(f"{victim} killed: live bytes after {live_s:.2f} s, shown stuck after {stuck_s:.2f} s")
        if victim == "host worker":
            await s.stack.restart_host_worker("a")
        else:
            await s.stack.restart_peerd("a")
        result = await handle.result()
        assert result["ready"] == ["a", "b"]
    finally:
        await s.stop()


async def test_abort_during_a_slow_load_cancels_it_and_nothing_stays_loaded(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"])
    try:
        for server in s.servers.values():
            server.faults = {("tiny", "v1"): {"load_delay_s": 6.0}}    # a load that takes a while (a large checkpoint)
        handle = await start_rollout(s.client, s.input(), f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        async def loading():
            st = await handle.query(RolloutWorkflow.status)
            return "loading" in st.hosts.values()
        await until(loading, 60, "a host loading")
        t0 = time.monotonic()
        await handle.execute_update(RolloutWorkflow.abort, "on-call: stop the load")
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        assert time.monotonic() - t0 < ACT_WITHIN_S                  # did not wait for the 6 s load

        async def nothing_resident():                                # the load finishes, then drops itself
            return all(("tiny", "v1") not in srv.versions and ("tiny", "v1") not in srv.engine.models for srv in s.servers.values())
        await until(nothing_resident, 15, "the aborted version gone from every model server")
        for h in ("a", "b"):
            assert s.m.digest not in await stored(s, h)
    finally:
        await s.stop()
