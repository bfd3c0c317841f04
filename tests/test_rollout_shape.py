"""The workflow's shape at fleet size: 2,000 hosts against the real dev server, with light activities
standing in for peerd and the model servers (the workflow code, children, limits and continue-as-new are
the real ones). Proves no history nears Temporal's limits and the load cap holds."""
import asyncio
import contextlib
import json
import uuid
import zlib

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from weightcast.stack.temporal import SEARCH_ATTRIBUTES, temporal_binary
from workers import control_worker
from workflows.rollout import RolloutWorkflow
from tests.golden import replays
from tests.history_sizes import payload_sizes
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from workflows.types import (CONTROL_QUEUE, DistributeInput, DistributeResult, HostSpec, LoadInput, ManifestRef,
                             RolloutInput)

pytestmark = pytest.mark.asyncio
HOSTS = 2000
MAX_LOADS = 40
FLEET_QUEUE = "shape-fleet"   # every emulated host's activities on one queue (HostSpec.task_queue)


class LightFleet:
    """Activities named like the real host activities; they track concurrency and fail some first attempts."""

    def __init__(self):
        self.loading = self.peak_loading = self.distributed = self.loaded = self.retried = 0

    def _flaky(self) -> None:
        info = activity.info()
        if info.attempt == 1 and zlib.crc32(f"{info.workflow_id}/{info.activity_id}".encode()) % 50 == 0:
            self.retried += 1
            raise ApplicationError("transient: peerd restarting")   # retryable: must be retried, not failed

    @activity.defn(name="distribute")
    async def distribute(self, inp: DistributeInput) -> DistributeResult:
        self._flaky()
        activity.heartbeat({"chunks_done": 1})
        self.distributed += 1
        return DistributeResult("vid", 1, {"peer": 1}, 0.0)

    @activity.defn(name="load_version")
    async def load_version(self, inp: LoadInput) -> dict:
        self.loading += 1
        self.peak_loading = max(self.peak_loading, self.loading)
        try:
            await asyncio.sleep(0.005)
            self._flaky()
            self.loaded += 1
            return {"model_version": inp.version}
        finally:
            self.loading -= 1


async def full_size_manifest(tmp_path, seaweed, keys) -> tuple[dict, ManifestRef]:
    """A manifest with as many chunks as 400 GB at 64 MiB, published where the control worker reads it."""
    from peerd import manifest as mf
    from peerd.origin import OriginSpec, S3Origin
    from weightcast.checkpoint_random import write_random_checkpoint
    ckpt = write_random_checkpoint(tmp_path / "big", 6_400 * 16, files=4, seed=9)
    m = mf.build_from_directory(ckpt, "tiny", "v1", chunk_size=16)
    spec = OriginSpec(seaweed.endpoint, seaweed.bucket, f"shape/{uuid.uuid4().hex[:6]}")
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        await o.ensure_bucket()
        await o.put_bytes(o.spec.key("signed.json"), mf.signed_bytes(m, keys["private"]))
    origin = {"endpoint": spec.endpoint, "bucket": spec.bucket, "prefix": spec.prefix}
    return origin, ManifestRef(m.digest, "signed.json")


@contextlib.asynccontextmanager
async def light_rollout(tmp_path, seaweed, keys, hosts: int, racks: int, max_loads: int, max_history_events: int):
    """A rollout of ``hosts`` light hosts on a fresh dev server, run to its end: yields (env, fleet,
    workflow id, result, final status) while the server is still up."""
    origin, ref = await full_size_manifest(tmp_path, seaweed, keys)
    fleet = LightFleet()
    async with await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                     search_attributes=SEARCH_ATTRIBUTES) as env:
        specs = [HostSpec(f"gpu-{i:04d}", rack=f"r{i % racks}", task_queue=FLEET_QUEUE) for i in range(hosts)]
        inp = RolloutInput(model="tiny", version="v1", signed_manifest="", origin=origin, manifest=ref, hosts=specs,
                           max_concurrent_loads=max_loads, batch_size=200, max_history_events=max_history_events)
        wid = f"rollout-shape-{uuid.uuid4().hex[:6]}"
        async with control_worker.build(env.client, [keys["pub_path"]], (ACCESS_KEY, SECRET_KEY)), \
                Worker(env.client, task_queue=FLEET_QUEUE, activities=[fleet.distribute, fleet.load_version],
                       max_concurrent_activities=400):
            handle = await env.client.start_workflow(RolloutWorkflow.run, inp, id=wid, task_queue=CONTROL_QUEUE)
            result = await asyncio.wait_for(handle.result(), 600)
            yield env, fleet, wid, result, await handle.query(RolloutWorkflow.status)


async def test_two_thousand_hosts_within_temporal_limits(tmp_path, seaweed, keys):
    async with light_rollout(tmp_path, seaweed, keys, HOSTS, 25, MAX_LOADS, 4000) as (env, fleet, wid, result, st):
        assert len(result["ready"]) == HOSTS and fleet.distributed == HOSTS and fleet.loaded == HOSTS
        assert fleet.retried > 0                              # transient failures were retried, not fatal
        assert 1 < fleet.peak_loading <= MAX_LOADS            # the load cap held at fleet size
        assert st.runs > 1 and st.phase == "done"             # the load phase continued-as-new
        # every history (each run of the parent, every batch child) stays far below Temporal's limits
        runs, longest, pending_peak, largest_payload, heaviest = 0, 0, 0, 0, 0
        async for wf in env.client.list_workflows(f"WorkflowId STARTS_WITH '{wid}'"):
            h = await env.client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            longest = max(longest, len(h.events))
            runs += wf.id == wid
            scheduled = sum(e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for e in h.events)
            pending_peak = max(pending_peak, scheduled)
            largest_payload = max([largest_payload, *payload_sizes(h)])
            heaviest = max(heaviest, sum(e.ByteSize() for e in h.events))
        print(json.dumps({"hosts": HOSTS, "manifest_chunks": 6_400, "runs": runs, "longest_history": longest,
                          "most_activities_in_one_history": pending_peak, "largest_payload_bytes": largest_payload,
                          "largest_history_bytes": heaviest, "peak_loading": fleet.peak_loading,
                          "retried": fleet.retried}))
        assert runs == st.runs
        assert longest < 10_000, f"a history reached {longest} events"
        assert pending_peak < 2000
        # the manifest (over a MB) travels by reference; the largest payload is the 2,000-host list itself
        # (input and continue-as-new carry, ~100 B a host), far below Temporal's 2 MB blob limit
        assert largest_payload < 512 * 1024 and heaviest < 8 * 1024 * 1024


async def test_the_load_phase_continues_as_new_and_each_run_replays(tmp_path, seaweed, keys):
    """A smaller fleet with the smallest history bound: the load phase continues-as-new, the second
    run resumes from the carried state, and both runs replay (kept as golden histories)."""
    async with light_rollout(tmp_path, seaweed, keys, 400, 5, 40, 1000) as (env, fleet, wid, result, st):
        assert len(result["ready"]) == 400 and st.runs > 1 and st.phase == "done"
        runs = [wf async for wf in env.client.list_workflows(f"WorkflowId = '{wid}'")]
        assert len(runs) == st.runs
        for i, wf in enumerate(sorted(runs, key=lambda w: w.start_time), 1):
            await replays(env.client.get_workflow_handle(wid, run_id=wf.run_id), f"continue-as-new-run-{i}",
                          compress=True)
