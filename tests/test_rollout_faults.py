"""Faults during a rollout, against the real dev server and real processes: a SIGKILLed host worker,
a SIGKILLed peerd, the Temporal server stopped mid-rollout, failures beyond the budget (paused, then
resumed or aborted), and invalid inputs."""
import asyncio
import json
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError

from peerd import manifest as mf
from peerd.client import PeerdClient, PeerdError
from tests.rollout_fixtures import Stack
from weightcast.rollout_status import live_status
from weightcast.rollouts import InvalidRolloutInput, start_rollout
from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, HostSpec

RATE = 128 * 1024        # bytes/s per link: the ~0.5 MB checkpoint takes seconds, long enough to strike mid-way


async def job(s: Stack, host: str) -> dict | None:
    try:
        async with PeerdClient(s.stack.peerd[host].addr, s.stack.token) as c:
            return await c.job(s.m.digest)
    except (PeerdError, OSError):
        return None


async def wait_progress(s: Stack, host: str, at_least: int = 2, timeout: float = 60) -> dict:
    """Until ``host`` has verified a few chunks but not all of them (mid-distribution)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        st = await job(s, host)
        if st and st["chunks_done"] >= at_least:
            assert st["chunks_done"] < st["chunks_total"], "too late: the host already has everything"
            return st
        await asyncio.sleep(0.02)
    seen = {h: await job(s, h) for h in s.stack.peerd}
    raise TimeoutError(f"{host} made no progress in {timeout} s; the hosts' jobs: {seen}")


async def live_progress(s: Stack, wid: str, host: str) -> dict:
    for _ in range(100):
        st = await live_status(s.client, wid)
        if host in st["progress"] and st["progress"][host]["bytes_done"] > 0:
            return st
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no live progress for {host}")


async def rollout_mid_distribution(s: Stack, wid: str = "", **kw):
    """Start a rollout and return once host a is part-way through its download."""
    wid = wid or f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}"
    handle = await start_rollout(s.client, s.input(**kw), wid)
    await wait_progress(s, "a")
    return wid, handle


def fetched(st: dict) -> int:
    return sum(st["bytes_by_source"].values())


async def distribute_attempts(s: Stack, wid: str) -> list[int]:
    h = await s.client.get_workflow_handle(f"{wid}-batch-0").fetch_history()
    return [e.activity_task_started_event_attributes.attempt for e in h.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]


async def test_host_worker_sigkilled_mid_distribution_resumes(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal)
    try:
        wid, handle = await rollout_mid_distribution(s, heartbeat_timeout_s=2)
        live = await live_progress(s, wid, "a")     # what `weightcast rollout status` shows mid-distribution
        assert 0 < live["progress"]["a"]["bytes_done"] < s.m.total_size and live["stuck"] == {}
        assert live["progress"]["a"]["chunks_total"] == len(s.m.chunks) and live["phase"] == "distribute"
        s.stack.host_workers["a"].kill()
        await asyncio.sleep(0.5)
        await s.stack.restart_host_worker("a")      # a supervisor restarts it; the heartbeat timeout retries
        result = await handle.result()
        assert result["ready"] == ["a", "b"]
        st = await job(s, "a")
        assert st["state"] == "complete" and fetched(st) == s.m.total_size   # the job went on; nothing twice
        assert max(await distribute_attempts(s, wid)) >= 2                    # the retry re-attached
    finally:
        await s.stop()


async def test_peerd_sigkilled_mid_distribution_resumes_from_bitmap(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, temporal=temporal)
    try:
        wid, handle = await rollout_mid_distribution(s)
        s.stack.peerd["a"].kill()
        bitmap = (s.stack.peerd["a"].store / "versions" / s.m.digest / "bitmap").read_bytes()
        kept = sum(c.size for c in s.m.chunks if bitmap[c.index])
        assert 0 < kept < s.m.total_size
        await s.stack.restart_peerd("a")
        result = await handle.result()
        assert result["ready"] == ["a", "b"]
        st = await job(s, "a")
        assert fetched(st) == s.m.total_size - kept     # no verified chunk fetched again
        assert max(await distribute_attempts(s, wid)) >= 2
    finally:
        await s.stop()


async def test_temporal_server_stopped_mid_rollout(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE)
    try:
        _, handle = await rollout_mid_distribution(s, heartbeat_timeout_s=5)
        await s.stack.stop_temporal()
        # the swarm needs no coordinator: both hosts finish while the server is down
        for _ in range(600):
            states = [(await job(s, h) or {}).get("state") for h in ("a", "b")]
            if states == ["complete", "complete"]:
                break
            await asyncio.sleep(0.1)
        assert states == ["complete", "complete"]
        await s.stack.start_temporal()
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}
    finally:
        await s.stop()


async def wait_paused(handle, timeout: float = 60):
    for _ in range(int(timeout / 0.1)):
        st = await handle.query(RolloutWorkflow.status)
        if st.paused:
            return st
        await asyncio.sleep(0.1)
    raise TimeoutError("the rollout did not pause")


async def test_failures_beyond_budget_pause_then_resume_or_abort(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        ghost = HostSpec("ghost", model_server="http://127.0.0.1:9")    # nobody polls host-ghost
        inp = s.input(failure_budget=0.0, unreachable_after_s=2)
        inp.hosts = inp.hosts + [ghost]
        handle = await start_rollout(s.client, inp, f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")
        st = await wait_paused(handle)
        assert st.hosts["ghost"] == "unreachable" and st.phase == "distribute"
        assert s.servers["a"].versions == {}                # paused: nothing loads while it waits
        await handle.signal(RolloutWorkflow.resume)
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}

        # v2 of the same bytes: pauses the same way, and the operator aborts → traffic back to v1
        m2 = mf.build_from_directory(tmp_path / "ckpt", "tiny", "v2", chunk_size=64 * 1024)
        inp2 = s.input(version="v2", signed_manifest=json.dumps(mf.sign_manifest(m2, keys["private"])),
                       failure_budget=0.0, unreachable_after_s=2, previous_version="v1")
        inp2.hosts = inp2.hosts + [ghost]
        handle2 = await start_rollout(s.client, inp2)
        await wait_paused(handle2)
        assert "aborting" in await handle2.execute_update(RolloutWorkflow.abort, "ghost host is gone for good")
        with pytest.raises(WorkflowFailureError) as e:
            await handle2.result()
        assert "aborted: ghost host is gone for good" in str(e.value.cause)
        weights = s.stack.router.table.models["tiny"].weights
        assert weights.get("v1") == 100 and not weights.get("v2")
        assert ("tiny", "v2") not in s.servers["a"].versions
    finally:
        await s.stop()


async def test_invalid_inputs_are_refused_with_clear_errors(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a"], temporal=temporal)
    try:
        bad = s.input(max_concurrent_loads=0, traffic_steps=[50, 10], failure_budget=2.0)
        bad.hosts = bad.hosts + [HostSpec("a", model_server="http://x")]
        with pytest.raises(InvalidRolloutInput) as e:
            await start_rollout(s.client, bad)
        for words in ("max_concurrent_loads must be an integer in [1, 10000]", "traffic_steps must rise",
                      "failure_budget is a fraction", "duplicate host ids: a"):
            assert words in str(e.value)
        # started around the client-side check, the workflow refuses it too, before touching any host
        handle = await s.client.start_workflow(RolloutWorkflow.run, bad, id=f"rollout-bad-{uuid.uuid4().hex[:6]}",
                                               task_queue=CONTROL_QUEUE)
        with pytest.raises(WorkflowFailureError) as e:
            await handle.result()
        assert "invalid rollout input" in str(e.value.cause)
        assert await job(s, "a") is None
    finally:
        await s.stop()
