"""RolloutWorkflow against the real Temporal dev server, real peerd processes, real S3, real
model servers and router (loopback)."""
import asyncio
import json
import os
import uuid
from pathlib import Path

import aiohttp
import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.testing import WorkflowEnvironment

from peerd import manifest as mf
from serving.checkpoint import write_checkpoint
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.fleet import TOKEN, Fleet, publish
from tests.serving_fixtures import SMALL
from tests.test_model_server import serve
from weightcast.rollouts import start_rollout
from weightcast.stack.temporal import SEARCH_ATTRIBUTES, temporal_binary
from workers import control_worker, host_worker
from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, HostSpec, RolloutInput

pytestmark = pytest.mark.asyncio
HISTORIES = Path(__file__).parent / "histories"


class Stack:
    """Everything a rollout touches, started for one test."""

    async def start(self, tmp: Path, seaweed, keys, ids: list[str]):
        self.env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                         search_attributes=SEARCH_ATTRIBUTES)
        self.client = self.env.client
        src = write_checkpoint(tmp / "ckpt", SMALL, seed=5, shard_bytes=64 * 1024, version="v1")
        self.m = mf.build_from_directory(src, "tiny", "v1", chunk_size=64 * 1024)
        self.signed = json.dumps(mf.sign_manifest(self.m, keys["private"]))
        self.origin = await publish(seaweed, src, f"r/{uuid.uuid4().hex[:8]}")
        self.fleet = Fleet(tmp, seaweed, keys["pub_path"], ids).start()
        self.servers, self.runners, self.hosts = {}, [], []
        self.router = Router(poll_interval=0.1)
        rr, self.router_addr = await serve(router_app(self.router))
        self.runners.append(rr)
        workers = [control_worker.build(self.client, [keys["pub_path"]])]
        for i in ids:
            self.servers[i] = ModelServer(i)
            r, addr = await serve(server_app(self.servers[i]))
            self.runners.append(r)
            self.hosts.append(HostSpec(i, model_server=addr))
            workers.append(host_worker.build(self.client, i, self.fleet.procs[i].addr, TOKEN,
                                             tmp / i / "store", addr))
        self.workers = workers
        self._tasks = [asyncio.create_task(w.run()) for w in workers]
        return self

    def input(self, **kw) -> RolloutInput:
        return RolloutInput(model="tiny", version="v1", signed_manifest=self.signed, origin=self.origin,
                            hosts=self.hosts, router=self.router_addr, step_wait_s=0.2, **kw)

    async def stop(self):
        for w in self.workers:
            await w.shutdown()
        for r in self.runners:
            await r.cleanup()
        self.fleet.stop()
        await self.env.shutdown()


async def test_rollout_end_to_end(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b", "c"])
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
        if os.environ.get("WEIGHTCAST_RECORD_HISTORIES"):
            HISTORIES.mkdir(exist_ok=True)
            hist = await handle.fetch_history()
            (HISTORIES / f"{wid}.json").write_text(hist.to_json())   # named by workflow id: replay needs it
    finally:
        await s.stop()


async def test_tampered_manifest_fails_and_nothing_loads(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a"])
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


async def test_unreachable_host_is_excluded_and_controls_validate(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"])
    try:
        inp = s.input(failure_budget=0.5, unreachable_after_s=3)
        inp.hosts = inp.hosts + [HostSpec("ghost")]         # nobody polls host-ghost
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
