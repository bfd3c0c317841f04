"""A manifest with as many chunks as a 400 GB checkpoint at 64 MiB (6,400; tiny chunks keep the bytes
small) published and rolled out by reference through the real workflow, dev server, S3, peerd and
model servers. No workflow payload carries the manifest: the largest payload in any history stays
a few KB while the signed manifest is over a MB."""
import json

from temporalio.api.enums.v1 import EventType

from peerd.origin import OriginSpec
from serving.checkpoint import write_checkpoint
from tests.golden import replays
from bench.rollout_shape import payload_sizes
from tests.serving_fixtures import SMALL
from weightcast.publish import PublishRequest, publish_and_start
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY

CHUNKS = 6_400


async def test_full_size_manifest_rolls_out_by_reference(tmp_path, seaweed, keys, temporal):
    src = write_checkpoint(tmp_path / "ckpt", SMALL, seed=5, shard_bytes=256 * 1024, version="v1")
    total = sum(p.stat().st_size for p in src.iterdir())
    chunk = total // CHUNKS
    stack = await EmbeddedStack(tmp_path / "stack", keys["pub_path"], ["a", "b"], s3=seaweed,
                                **temporal.stack_args()).start()
    try:
        req = PublishRequest(src, "tiny", "v1", keys["priv_path"],
                             OriginSpec(seaweed.endpoint, seaweed.bucket, "full-size/v1"), chunk_size=chunk,
                             access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        out = await publish_and_start(stack.client, req, stack.hosts, router=stack.router_addr, step_wait_s=0.0)
        handle = stack.client.get_workflow_handle(out["workflow_id"])
        result = await handle.result()
        assert result["ready"] == ["a", "b"] and result["traffic"] == {"v1": 100}
        signed_size = len(json.dumps(json.loads(
            (stack.peerd["a"].store / "versions" / result["version_id"] / "manifest.json").read_bytes())))
        manifest = json.loads((stack.peerd["a"].store / "versions" / result["version_id"] / "manifest.json").read_bytes())
        assert len(manifest["manifest"]["chunks"]) >= CHUNKS and signed_size > 1_000_000
        histories = [await handle.fetch_history()]
        await replays(handle, "preempt-manifest-by-ref")
        async for wf in stack.client.list_workflows("WorkflowType = 'PreflightWorkflow'"):   # publish's pre-checks
            await replays(stack.client.get_workflow_handle(wf.id, run_id=wf.run_id), "preflight")
        for e in histories[0].events:
            if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
                wid = e.start_child_workflow_execution_initiated_event_attributes.workflow_id
                histories.append(await stack.client.get_workflow_handle(wid).fetch_history())
        largest = max(s for h in histories for s in payload_sizes(h))
        history_bytes = max(sum(e.ByteSize() for e in h.events) for h in histories)
        print(json.dumps({"chunks": len(manifest["manifest"]["chunks"]), "signed_manifest_bytes": signed_size,
                          "largest_payload_bytes": largest, "largest_history_bytes": history_bytes}))
        assert largest < 16_384 and history_bytes < 256 * 1024
    finally:
        await stack.stop()
