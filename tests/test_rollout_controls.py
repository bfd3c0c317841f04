"""On-call controls that act at once, against the real dev server, host worker processes and peerd:
pause stops every download mid-distribution and resume continues from the bitmaps; abort stops the
downloads, removes the aborted version from every store and closes the workflow; an abort during a
traffic step's dwell does not wait for the dwell to end.

Each control acts on something that cannot end by itself first (a download whose last file the origin
withholds, a load held by its gate, a dwell of minutes), so the tests hold on a slow machine too; how
long each control took is printed (docs/control-plane.md has the figures)."""
import asyncio
import contextlib
import io
import json
import time
import uuid

import pytest
from temporalio.client import WorkflowFailureError

from peerd.client import PeerdClient, PeerdError
from tests.golden import replays
from tests.rollout_fixtures import Stack
from tests.test_rollout_faults import RATE, fetched, job, rollout_mid_distribution, wait_progress
from tests.waiting import until
from weightcast.rollout_status import live_status
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow

CONTROL_WAIT_S = 60.0    # a bound on waiting for a control, not a claim about its speed


async def until_loading(handle):
    async def loading():
        st = await handle.query(RolloutWorkflow.status)
        return "loading" in st.hosts.values() and st
    return await until(loading, 60, "a host loading")


async def until_traffic(handle, weights: dict):
    async def there():
        return (await handle.query(RolloutWorkflow.status)).traffic == weights
    await until(there, 60, f"traffic at {weights}")


async def stored(s: Stack, host: str) -> list[str]:
    async with PeerdClient(s.stack.peerd[host].addr, s.stack.token) as c:
        return (await c.status())["stored_versions"]


async def test_pause_stops_every_download_within_seconds_and_resume_continues_from_the_bitmaps(
        tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal, withhold=True)
    try:
        _, handle = await rollout_mid_distribution(s, "rollout-tiny-v1-paused")
        t0 = time.monotonic()
        await handle.signal(RolloutWorkflow.pause)

        async def both_stopped():
            states = [(await job(s, h) or {}).get("state") for h in ("a", "b")]
            return all(st == "stopped" for st in states)
        await until(both_stopped, CONTROL_WAIT_S, "both downloads stopped after pause")
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
        st = await until(lambda: held(handle), CONTROL_WAIT_S, "the pause acted on")
        live = await live_status(s.client, handle.id)                 # while paused: the bytes held
        assert st.bytes_done == live["bytes_done"] == kept["a"] + kept["b"] and st.held == kept
        await s.release()
        await handle.signal(RolloutWorkflow.resume)
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}
        for h in ("a", "b"):
            st = await job(s, h)
            assert st["state"] == "complete" and fetched(st) == s.m.total_size - kept[h]   # nothing twice
        await replays(handle, "preempt-paused-mid-distribution")
        await replays(s.client.get_workflow_handle(f"{handle.id}-batch-0"), "host-batch-stopped")
        await replays(s.client.get_workflow_handle(f"{handle.id}-batch-0-r1"), "host-batch-resumed")
        print(f"pause: downloads stopped {stop_s:.2f} s after the signal")
    finally:
        await s.stop()


async def test_abort_mid_distribution_stops_downloads_and_removes_the_version_within_seconds(
        tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal, withhold=True)
    try:
        _, handle = await rollout_mid_distribution(s, "rollout-tiny-v1-aborted")
        assert s.m.digest in await stored(s, "a")
        t0 = time.monotonic()
        assert "aborting" in await handle.execute_update(RolloutWorkflow.abort, "on-call: wrong checkpoint")
        with pytest.raises(WorkflowFailureError) as e:
            await asyncio.wait_for(handle.result(), CONTROL_WAIT_S)     # the downloads could never finish
        closed_s = time.monotonic() - t0
        assert "aborted: on-call: wrong checkpoint" in str(e.value.cause)
        for h in ("a", "b"):
            assert s.m.digest not in await stored(s, h)                 # gone from every store
            assert not (s.stack.peerd[h].store / "versions" / s.m.digest).exists()
            with pytest.raises(PeerdError):                              # and its job with it
                async with PeerdClient(s.stack.peerd[h].addr, s.stack.token) as c:
                    await c.job(s.m.digest)
        st = await handle.query(RolloutWorkflow.status)
        assert st.phase == "failed" and set(st.hosts.values()) == {"discarded"}
        for h in ("a", "b"):                 # an abort is expected: no host worker logs a traceback for it
            assert "Traceback" not in s.stack.host_workers[h].log_path.read_text()
        await replays(handle, "preempt-aborted-mid-distribution")
        print(f"abort: workflow closed and version removed {closed_s:.2f} s after the update")
    finally:
        await s.stop()


async def test_abort_during_a_traffic_dwell_does_not_wait_for_it(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        inp = s.input(traffic_steps=[10, 100])
        inp.step_wait_s = 300                      # an hour-long bake would look the same
        handle = await start_rollout(s.client, inp, f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        await until_traffic(handle, {"v1": 10})
        t0 = time.monotonic()
        await handle.execute_update(RolloutWorkflow.abort, "on-call: latency regression")
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), CONTROL_WAIT_S)     # a fifth of the dwell
        print(f"abort during a dwell: closed {time.monotonic() - t0:.2f} s after the update")
        # no previous version to return to: v1 still serves its 10 %, so it is left loaded and stored
        assert s.stack.router.table.models["tiny"].weights.get("v1") == 10
        assert ("tiny", "v1") in s.servers["a"].versions and s.m.digest in await stored(s, "a")
    finally:
        await s.stop()


@pytest.mark.parametrize("victim", ["host worker", "peerd"])
async def test_status_shows_live_bytes_and_a_downed_host_as_stuck_with_the_reason(
        tmp_path, seaweed, keys, victim, temporal):
    """A killed host worker or peerd shows in `rollout status` as stuck, with the reason (times printed;
    the limits are ~3x what is measured, the figures are docs/control-plane.md's);
    restarted, the host's download carries on at once: a restarted worker hands its dead predecessor's
    attempt back instead of waiting out the (here 120 s) heartbeat timeout."""
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal)
    try:
        wid = f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}"
        handle = await start_rollout(s.client, s.input(heartbeat_timeout_s=120), wid)
        await wait_progress(s, "a", at_least=1)
        t0 = time.monotonic()

        async def live_bytes():
            st = await live_status(s.client, wid)
            return st["progress"].get("a", {}).get("bytes_done", 0) > 0 and st
        await until(live_bytes, 9.0, "live bytes for host a in `rollout status`")
        live_s = time.monotonic() - t0

        proc = s.stack.host_workers["a"] if victim == "host worker" else s.stack.peerd["a"]
        proc.kill()
        t1 = time.monotonic()

        async def a_stuck():
            st = await live_status(s.client, wid)
            return "a" in st["stuck"] and st
        st = await until(a_stuck, 12.0, f"host a shown stuck after its {victim} was killed", every=0.25)
        stuck_s = time.monotonic() - t1
        assert "b" not in st["stuck"]
        reason = st["stuck"]["a"]
        if victim == "host worker":
            assert "no heartbeat" in reason and "host worker" in reason, reason
        else:
            assert "retrying" in reason and "peerd at" in reason and "unreachable" in reason, reason
        print(f"{victim} killed: live bytes after {live_s:.2f} s, shown stuck after {stuck_s:.2f} s: {reason}")
        if victim == "host worker":
            await s.stack.restart_host_worker("a")
        else:
            await s.stack.restart_peerd("a")
        t2 = time.monotonic()

        async def a_moving():
            st = await live_status(s.client, wid)
            p = st["progress"].get("a")
            return (st["phase"] != "distribute" or (p and "a" not in st["stuck"] and p["attempt"] > 1)) and st
        await until(a_moving, 30.0, "host a's download running again", every=0.25)
        print(f"{victim} restarted: host a's download running again after {time.monotonic() - t2:.2f} s")
        result = await handle.result()
        assert result["ready"] == ["a", "b"]
    finally:
        await s.stop()


async def test_abort_during_a_slow_load_cancels_it_and_nothing_stays_loaded(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        gate = hold_loads(s)                                          # a load that takes a while (a large checkpoint)
        handle = await start_rollout(s.client, s.input(), f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        await until_loading(handle)
        t0 = time.monotonic()
        await handle.execute_update(RolloutWorkflow.abort, "on-call: stop the load")
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), CONTROL_WAIT_S)   # the loads are still held
        print(f"abort during a load: closed {time.monotonic() - t0:.2f} s after the update")
        gate.set()

        async def nothing_resident():                                # the load finishes, then drops itself
            return all(("tiny", "v1") not in srv.versions and ("tiny", "v1") not in srv.engine.models for srv in s.servers.values())
        await until(nothing_resident, 15, "the aborted version gone from every model server")
        for h in ("a", "b"):
            assert s.m.digest not in await stored(s, h)
    finally:
        await s.stop()


def hold_loads(s: Stack) -> asyncio.Event:
    """Every model server's load of tiny v1 waits for the returned gate."""
    gate = asyncio.Event()
    for server in s.servers.values():
        server.faults = {("tiny", "v1"): {"load_gate": gate}}
    return gate


async def activity_starts(handle, activity: str) -> int:
    """How many times the workflow has scheduled ``activity`` (its history)."""
    hist = await handle.fetch_history()
    return sum(1 for e in hist.events if e.HasField("activity_task_scheduled_event_attributes")
               and e.activity_task_scheduled_event_attributes.activity_type.name == activity)


async def held(handle) -> bool:
    """The workflow has acted on a pause: it holds, and no control is waiting to be acted on."""
    st = await handle.query(RolloutWorkflow.status)
    return st.paused and not st.control and st


async def refused_traffic_step(s: Stack, **kw):
    """v1 serving on a and b, then v2 rolled out after v1 was unloaded from b: the router refuses
    {v2: 1, v1: 99} (v1 on one of two hosts cannot carry 99 %), so the first traffic step retries.
    Returns the handle once status shows that step retrying."""
    first = await start_rollout(s.client, s.input(traffic_steps=[100]))
    assert (await first.result())["ready"] == ["a", "b"]
    v2 = await s.publish("tiny", "v2", seed=9)
    assert s.servers["b"].unload(("tiny", "v1"))
    handle = await start_rollout(s.client, s.input(**v2, previous_version="v1", traffic_steps=[1, 100], **kw))

    async def retrying():
        st = await handle.query(RolloutWorkflow.status)
        return [r for r in st.retrying if r["step"] == "traffic 1%"] and st
    st = await until(retrying, 90, "the first traffic step retrying")
    [r] = [r for r in st.retrying if r["step"] == "traffic 1%"]
    assert r["activity"] == "set_traffic" and r["attempt"] >= 1 and r["next_retry_at"]
    assert "router refused weights" in r["error"] and "v1" in r["error"]
    return handle


async def mend(s: Stack) -> None:
    """v1 loaded on b again: the step that was refused can now succeed."""
    vs = await s.servers["b"].load(("tiny", "v1"), s.stack.peerd["b"].store / "versions" / s.m.digest / "model")
    assert vs.state == "ready"


async def test_pause_then_abort_while_a_traffic_step_is_retrying(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        handle = await refused_traffic_step(s)
        t0 = time.monotonic()
        await handle.signal(RolloutWorkflow.pause)
        st = await until(lambda: held(handle), CONTROL_WAIT_S, "the pause acted on")
        pause_s = time.monotonic() - t0
        assert st.phase == "traffic" and "PAUSED" in st.detail
        tries = await activity_starts(handle, "set_traffic")
        await asyncio.sleep(3)                                   # longer than the next retry was due
        assert await activity_starts(handle, "set_traffic") == tries   # no retry while paused

        t1 = time.monotonic()
        await handle.execute_update(RolloutWorkflow.abort, "on-call: v2 cannot take traffic")
        st = await handle.query(RolloutWorkflow.status)
        assert "abort requested" in st.control or st.phase in ("aborting", "failed")   # shown until acted on
        with pytest.raises(WorkflowFailureError) as e:
            await asyncio.wait_for(handle.result(), CONTROL_WAIT_S)
        abort_s = time.monotonic() - t1
        assert "on-call: v2 cannot take traffic" in str(e.value.cause)
        assert s.stack.router.table.models["tiny"].weights == {"v1": 100.0, "v2": 0.0}   # traffic back on v1
        assert all(("tiny", "v2") not in srv.versions for srv in s.servers.values())
        await replays(handle, "preempt-traffic-retrying-paused-then-aborted")
        print(f"retrying traffic step: pause held after {pause_s:.2f} s, abort closed after {abort_s:.2f} s")
    finally:
        await s.stop()


async def test_a_step_failing_past_its_bound_pauses_as_stuck_and_resumes_once_mended(tmp_path, seaweed, keys, temporal):
    from weightcast.cli import main
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        handle = await refused_traffic_step(s, stuck_after_s=3)
        st = await until(lambda: held(handle), 30, "the stuck step pausing the rollout")
        assert st.stuck_step.startswith("traffic 1% has failed for") and "router refused weights" in st.stuck_step
        assert st.detail.startswith("STUCK, PAUSED")
        # `rollout status --watch` (what `publish --wait` runs) says so and exits 4: an operator's turn
        where = ["--temporal", s.stack.temporal_addr, "--namespace", s.stack.namespace]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = await asyncio.to_thread(main, ["rollout", "status", handle.id, "--watch", *where])
        final = json.loads(out.getvalue().strip().splitlines()[-1])
        assert rc == 4 and final["status"] == "STUCK" and "router refused weights" in final["stuck"]

        await mend(s)
        assert await asyncio.to_thread(main, ["rollout", "resume", handle.id, *where]) == 0
        result = await handle.result()
        assert result["traffic"] == {"v2": 100} and (await handle.query(RolloutWorkflow.status)).stuck_step == ""
        await replays(handle, "preempt-stuck-then-resumed")
    finally:
        await s.stop()


async def test_pause_and_resume_in_the_load_phase(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        gate = hold_loads(s)                                     # each load takes a while
        handle = await start_rollout(s.client, s.input(max_concurrent_loads=1),
                                     f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        await until_loading(handle)
        await handle.signal(RolloutWorkflow.pause)
        st = await until(lambda: held(handle), CONTROL_WAIT_S, "the pause acted on in the load phase")
        assert st.phase == "load"
        loads = await activity_starts(handle, "load_version")
        gate.set()                                               # the load in flight ends on its server ...

        async def no_load_running():
            return all(vs.state != "loading" for srv in s.servers.values() for vs in srv.versions.values())
        await until(no_load_running, CONTROL_WAIT_S, "the held load finished on its model server")
        await asyncio.sleep(1)                                   # ... and no other starts while paused
        st = await handle.query(RolloutWorkflow.status)
        assert await activity_starts(handle, "load_version") == loads and "ready" not in st.hosts.values()
        await handle.signal(RolloutWorkflow.resume)
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["peak_loads"] == 1
        await replays(handle, "preempt-load-phase-paused")
    finally:
        await s.stop()


async def test_set_concurrency_changes_how_many_hosts_load_at_once(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        gate = hold_loads(s)
        handle = await start_rollout(s.client, s.input(max_concurrent_loads=1),
                                     f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        await until_loading(handle)
        assert (await handle.query(RolloutWorkflow.status)).peak_loads == 1
        assert await handle.execute_update(RolloutWorkflow.set_max_concurrent_loads, 2) == 2

        async def both_loading():
            return (await handle.query(RolloutWorkflow.status)).peak_loads == 2
        await until(both_loading, CONTROL_WAIT_S, "b loading beside a")
        gate.set()
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["peak_loads"] == 2     # b started beside a
    finally:
        await s.stop()


async def test_pause_and_resume_during_a_traffic_dwell_through_the_cli(tmp_path, seaweed, keys, temporal):
    from weightcast.cli import main
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        inp = s.input(traffic_steps=[10, 100])
        inp.step_wait_s = 3
        handle = await start_rollout(s.client, inp, f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")

        await until_traffic(handle, {"v1": 10})
        where = ["--temporal", s.stack.temporal_addr, "--namespace", s.stack.namespace]
        assert await asyncio.to_thread(main, ["rollout", "pause", handle.id, *where]) == 0
        await until(lambda: held(handle), CONTROL_WAIT_S, "the pause acted on during the dwell")
        await asyncio.sleep(4)                                    # longer than the dwell: it does not run out
        st = await handle.query(RolloutWorkflow.status)
        assert st.phase == "traffic" and st.traffic == {"v1": 10}
        assert await asyncio.to_thread(main, ["rollout", "resume", handle.id, *where]) == 0
        result = await handle.result()
        assert result["traffic"] == {"v1": 100}
    finally:
        await s.stop()
