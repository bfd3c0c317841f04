"""`weightcast bench rollout-shape`: a rollout's shape at fleet size against the real dev server. The
workflow code, its children, limits and continue-as-new are the real ones; light activities named
like the host activities stand in for peerd and the model servers (one worker serves every host's
queue), so what is measured is Temporal's side: the largest payload any history recorded, the
longest history, the heaviest history, and the wall time. The manifest is a full-size one (6,400
chunks) and the host list travels by reference (``InventoryRef``), both read by the real control
worker (a process of its own, `python -m workers.control_worker`) from SeaweedFS."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
import zlib
from pathlib import Path

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities import inventory
from lib.ports import free_ports
from peerd import manifest as mf
from peerd.origin import OriginSpec, S3Origin
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.stack.module_proc import ModuleProc
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from weightcast.stack.temporal import TemporalDevServer
from workflows.rollout import RolloutWorkflow
from workflows.types import (CONTROL_QUEUE, DistributeInput, DistributeResult, HostSpec, LoadInput, ManifestRef,
                             RolloutInput)

FLEET_QUEUE = "shape-fleet"   # every emulated host's activities on one queue (HostSpec.task_queue)
MANIFEST_CHUNKS = 6_400       # as many as 400 GB in 64 MiB chunks


class LightFleet:
    """Activities named like the real host activities; they track concurrency and fail some first attempts."""

    def __init__(self):
        self.loading = self.peak_loading = self.distributed = self.loaded = self.retried = 0

    def _flaky(self) -> None:
        info = activity.info()
        # the first try only: Temporal's own retries count attempts; the workflow's steps retry as new
        # activities whose ids end in #<try>
        step, _, tries = info.activity_id.rpartition("#")
        first = info.attempt == 1 and (not step or tries == "1")
        if first and zlib.crc32(f"{info.workflow_id}/{step or info.activity_id}".encode()) % 50 == 0:
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


async def publish(work: Path, endpoint: str, bucket: str, private_key, hosts: list[HostSpec],
                  by_reference: bool) -> tuple[dict, ManifestRef, dict]:
    """A full-size manifest (16-byte chunks: the shape, not the bytes) and, by reference, the host list,
    where the control worker reads them. Returns (origin, manifest ref, the input's host fields)."""
    ckpt = write_random_checkpoint(work / "ckpt", MANIFEST_CHUNKS * 16, files=4, seed=9)
    m = mf.build_from_directory(ckpt, "tiny", "v1", chunk_size=16)
    spec = OriginSpec(endpoint, bucket, f"shape/{uuid.uuid4().hex[:6]}")
    fleet: dict = {"hosts": hosts}
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        await o.ensure_bucket()
        await o.put_bytes(o.spec.key("signed.json"), mf.signed_bytes(m, private_key))
        if by_reference:
            raw, ref = inventory.encode(hosts)
            await o.put_bytes(o.spec.key(ref.key), raw)
            fleet = {"hosts": [], "inventory": ref}
    origin = {"endpoint": spec.endpoint, "bucket": spec.bucket, "prefix": spec.prefix}
    return origin, ManifestRef(m.digest, "signed.json"), fleet


def fleet_specs(hosts: int, racks: int) -> list[HostSpec]:
    return [HostSpec(f"gpu-{i:05d}", rack=f"r{i % racks}", task_queue=FLEET_QUEUE) for i in range(hosts)]


@contextlib.asynccontextmanager
async def light_rollout(work: Path, endpoint: str, bucket: str, keys: dict, hosts: int, racks: int, max_loads: int,
                        max_history_events: int, by_reference: bool = True):
    """A rollout of ``hosts`` light hosts on a fresh dev server, run to its end: yields (client, fleet,
    workflow id, result, final status, wall seconds) while the server is still up. ``keys``: the
    signing key pair ({"private", "pub_path"})."""
    origin, ref, fleet_fields = await publish(work, endpoint, bucket, keys["private"], fleet_specs(hosts, racks),
                                              by_reference)
    fleet = LightFleet()
    # the project's own dev server (in memory): its output goes to its log, never into the JSON printed
    server = TemporalDevServer(free_ports(1)[0], None, work / "temporal.log").launch()
    try:
        client = await server.wait_ready()
        inp = RolloutInput(model="tiny", version="v1", signed_manifest="", origin=origin, manifest=ref,
                           max_concurrent_loads=max_loads, batch_size=200, max_history_events=max_history_events,
                           **fleet_fields)
        wid = f"rollout-shape-{uuid.uuid4().hex[:6]}"
        # the real control worker, a process of its own as in production (not sharing a GIL with the
        # light fleet's hundreds of activities)
        control = ModuleProc("control worker", "workers.control_worker", work / "control",
                             ["--temporal", server.address, "--trusted-key", str(keys["pub_path"])],
                             {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
        try:
            control.launch()                       # from the main thread: it dies with this process
            await asyncio.to_thread(control.wait_ready, 60)
            async with Worker(client, task_queue=FLEET_QUEUE, activities=[fleet.distribute, fleet.load_version],
                              max_concurrent_activities=400):
                t0 = time.monotonic()
                handle = await client.start_workflow(RolloutWorkflow.run, inp, id=wid, task_queue=CONTROL_QUEUE)
                result = await asyncio.wait_for(_result_while_alive(handle, control), 1800)
                wall = time.monotonic() - t0
                yield client, fleet, wid, result, await handle.query(RolloutWorkflow.status), wall
        finally:
            control.stop()
        if control.proc.returncode != 0:           # reached only when nothing else failed
            raise RuntimeError(f"the control worker did not stop cleanly on SIGTERM: {control.death()}")
    finally:
        server.stop()


async def _result_while_alive(handle, proc: ModuleProc):
    """The workflow's result; RuntimeError with its last words if ``proc`` dies before it."""
    result = asyncio.ensure_future(handle.result())
    while not (await asyncio.wait({result}, timeout=1.0))[0]:
        if not proc.running:
            result.cancel()
            raise RuntimeError(f"the control worker died: {proc.death()}")
    return result.result()


def payload_sizes(history) -> list[int]:
    """Byte sizes of every payload recorded in a history (inputs, results, heartbeats, signals)."""
    sizes = []

    def walk(msg):
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            if hasattr(value, "ListFields"):
                items = [value]
            elif hasattr(value, "values") and callable(value.values):    # map fields (memo, headers)
                items = list(value.values())
            else:                                                         # repeated fields
                items = list(value)
            for v in items:
                if field.message_type.full_name == "temporal.api.common.v1.Payload":
                    sizes.append(v.ByteSize())
                elif hasattr(v, "ListFields"):
                    walk(v)
    for e in history.events:
        walk(e)
    return sizes


async def history_shape(client, wid: str) -> dict:
    """Every history of a rollout (each run of the parent, every batch child): how far from Temporal's limits."""
    runs = longest = pending_peak = largest_payload = heaviest = 0
    async for wf in client.list_workflows(f"WorkflowId STARTS_WITH '{wid}'"):
        h = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        longest = max(longest, len(h.events))
        runs += wf.id == wid
        scheduled = sum(e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for e in h.events)
        pending_peak = max(pending_peak, scheduled)
        largest_payload = max([largest_payload, *payload_sizes(h)])
        heaviest = max(heaviest, sum(e.ByteSize() for e in h.events))
    return {"runs": runs, "longest_history": longest, "most_activities_in_one_history": pending_peak,
            "largest_payload_bytes": largest_payload, "largest_history_bytes": heaviest}


async def run_rollout_shape(hosts: int, racks: int, max_loads: int, max_history_events: int) -> dict:
    from peerd.signing import generate_keypair, load_private_key
    from weightcast.stack.seaweed import SeaweedS3
    work = Path(tempfile.mkdtemp(prefix="wc-shape-"))
    generate_keypair(work / "k.pem", work / "k.pub")
    keys = {"private": load_private_key(work / "k.pem"), "pub_path": work / "k.pub"}
    s3 = SeaweedS3(work / "s3").start()
    try:
        async with light_rollout(work, s3.endpoint, s3.bucket, keys, hosts, racks, max_loads,
                                 max_history_events) as (client, fleet, wid, result, st, wall):
            shape = await history_shape(client, wid)
        return {"hosts": hosts, "racks": racks, "manifest_chunks": MANIFEST_CHUNKS, "inventory": "by reference",
                "ready": len(result["ready"]), "phase": st.phase, "states": st.counts,
                "errors": dict(list(result["errors"].items())[:5]), "wall_s": round(wall, 1), **shape,
                "temporal_blob_limit_bytes": 2 * 1024 * 1024, "peak_loading": fleet.peak_loading,
                "max_concurrent_loads": max_loads, "retried": fleet.retried}
    finally:
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)


def main_json(hosts: int, racks: int, max_loads: int, max_history_events: int) -> str:
    # the light hosts fail some first attempts on purpose: their retries are counted, not logged
    logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    return json.dumps(asyncio.run(run_rollout_shape(hosts, racks, max_loads, max_history_events)), indent=2)
