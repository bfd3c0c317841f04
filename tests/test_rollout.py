"""RolloutWorkflow against the real Temporal dev server, real peerd processes, real S3, real
model servers and router (loopback)."""
import json
import uuid
from pathlib import Path

import aiohttp
import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import WorkflowAlreadyStartedError

from tests.golden import replays
from tests.rollout_fixtures import Stack
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, HostSpec


async def test_rollout_end_to_end(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b", "c"], temporal=temporal)
    try:
        wid = f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}"
        handle = await start_rollout(s.client, s.input(), wid)
        again = await start_rollout(s.client, s.input(), wid)      # a retried CI job attaches
        assert again.result_run_id == handle.result_run_id
        result = await handle.result()
        assert result["ready"] == ["a", "b", "c"] and result["traffic"] == {"v1": 100}
        st = await handle.query(RolloutWorkflow.status)
        assert st.phase == "done" and st.counts == {"ready": 3}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{s.router_addr}/v1/models/tiny/infer", json={"input_ids": [[1, 2, 3]]}) as r:
                body = await r.json()
        assert r.status == 200 and body["model_version"] == "v1"
        # the same version is never rolled out twice by accident
        with pytest.raises(WorkflowAlreadyStartedError):
            await start_rollout(s.client, s.input(), wid)
        await replays(handle, "preempt-end-to-end")
        # the stack's peerds, host workers and servers got their tokens by environment: `ps` shows none
        children = [p.proc.pid for p in [*s.stack.peerd.values(), *s.stack.host_workers.values()]]
        assert len(children) == 6 and not leaks(s.stack.token) and not leaks(s.stack.admin_token)
    finally:
        await s.stop()


def leaks(secret: str) -> list[str]:
    """The command lines of this machine's processes that hold ``secret``."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = cmdline.read_bytes()
        except OSError:                 # a process that ended meanwhile
            continue
        if secret.encode() in raw:
            out.append(raw.replace(b"\0", b" ").decode(errors="replace"))
    return out


async def test_tampered_manifest_fails_and_nothing_loads(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a"], temporal=temporal)
    try:
        doc = json.loads(s.signed)
        doc["manifest"]["chunks"][0]["digest"] = "0" * 64
        inp = s.input()
        inp.signed_manifest = json.dumps(doc)
        handle = await s.client.start_workflow(RolloutWorkflow.run, inp, id=f"rollout-bad-{uuid.uuid4().hex[:6]}",
                                               task_queue=CONTROL_QUEUE)
        with pytest.raises(WorkflowFailureError) as e:
            await handle.result()
        assert "bad signature" in str(e.value.cause)
        assert s.servers["a"].versions == {}
    finally:
        await s.stop()


async def test_unreachable_host_is_excluded_and_controls_validate(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    try:
        inp = s.input(failure_budget=0.5, unreachable_after_s=3)
        inp.hosts = inp.hosts + [HostSpec("ghost", model_server="http://127.0.0.1:9")]   # nobody polls host-ghost
        handle = await s.client.start_workflow(RolloutWorkflow.run, inp, id=f"rollout-ghost-{uuid.uuid4().hex[:6]}",
                                               task_queue=CONTROL_QUEUE)
        with pytest.raises(WorkflowUpdateFailedError) as e:
            await handle.execute_update(RolloutWorkflow.set_max_concurrent_loads, 0)
        assert "max_concurrent_loads must be an integer" in str(e.value.cause)
        with pytest.raises(WorkflowUpdateFailedError) as e:
            await handle.execute_update(RolloutWorkflow.abort, " ")
        assert "abort needs a reason" in str(e.value.cause)
        assert await handle.execute_update(RolloutWorkflow.set_max_concurrent_loads, 1) == 1
        result = await handle.result()
        assert result["hosts"]["ghost"] == "unreachable" and result["ready"] == ["a", "b"]
    finally:
        await s.stop()
