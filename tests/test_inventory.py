"""The fleet's host list by reference: what a rollout refuses before it starts, what the control
worker refuses when it reads the list, and a rollout whose list was altered after it started."""
import dataclasses
import uuid

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from activities import inventory
from bench.rollout_shape import fleet_specs, publish
from peerd.origin import OriginSpec, S3Origin
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY
from workflows.types import INLINE_HOSTS_MAX, HostSpec, ManifestRef, RolloutInput

ORIGIN = {"endpoint": "http://127.0.0.1:1", "bucket": "b", "prefix": "p"}


def rollout(**kw) -> RolloutInput:
    return RolloutInput("m", "v1", "", ORIGIN, kw.pop("hosts", []), manifest=ManifestRef("a" * 64), **kw)


def test_a_rollout_takes_its_hosts_inline_or_by_reference_not_both():
    hosts = [HostSpec("h0"), HostSpec("h1")]
    _, ref = inventory.encode(hosts)
    assert rollout(hosts=hosts).problems() == []
    assert rollout(inventory=ref).problems() == []
    assert any("not both" in p for p in rollout(hosts=hosts, inventory=ref).problems())
    assert any("hosts is empty" in p for p in rollout().problems())
    bad = dataclasses.replace(ref, sha256="xyz", count=0)
    assert {p.split(" ")[0] for p in rollout(inventory=bad).problems()} == {"inventory.sha256", "inventory.count"}
    many = [HostSpec(f"h{i}") for i in range(INLINE_HOSTS_MAX + 1)]
    assert any("inventory={sha256, key, count}" in p for p in rollout(hosts=many).problems())


def test_the_list_is_named_by_its_digest_and_read_back_only_unaltered():
    hosts = [HostSpec("h0", "http://10.0.0.1:8100", "r0"), HostSpec("h1", "http://10.0.0.2:8100", "r1", "q")]
    raw, ref = inventory.encode(hosts)
    assert ref.count == 2 and ref.sha256[:16] in ref.key
    assert inventory.decode(raw, ref, True, "s3://b/k") == hosts
    with pytest.raises(inventory.InventoryError, match="does not hash to"):
        inventory.decode(raw.replace(b"10.0.0.2", b"10.6.6.6"), ref, False, "s3://b/k")
    for other, match in (([HostSpec("h0"), HostSpec("h0")], "duplicate host ids: h0"),
                         ([HostSpec("h0"), HostSpec("h 1")], "bad host ids"),
                         ([HostSpec("h0")], "it lists 1 hosts, the rollout expects 2")):
        raw2, ref2 = inventory.encode(other)
        with pytest.raises(inventory.InventoryError, match=match):
            inventory.decode(raw2, dataclasses.replace(ref2, count=2), False, "s3://b/k")
    raw3, ref3 = inventory.encode([HostSpec("h0")])
    with pytest.raises(inventory.InventoryError, match="needs its model_server"):
        inventory.decode(raw3, ref3, True, "s3://b/k")
    plan = inventory.plan(hosts)
    assert [h.queue for h in plan.specs()] == ["host-h0", "q"] and set(plan.seeders) == {"h0", "h1"}


async def test_a_host_list_altered_after_the_start_is_refused_and_nothing_is_distributed(tmp_path, seaweed, keys, temporal):
    """The control worker reads the list when the rollout gets to it: bytes that no longer hash to the
    reference fail the rollout with the reason, before any host is asked to download."""
    from workers import control_worker
    from workflows.rollout import RolloutWorkflow
    from workflows.types import CONTROL_QUEUE
    origin, ref, fleet = await publish(tmp_path, seaweed.endpoint, seaweed.bucket, keys["private"],
                                       fleet_specs(3, 1), by_reference=True)
    spec = OriginSpec(origin["endpoint"], origin["bucket"], origin["prefix"])
    async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
        raw, _ = inventory.encode(fleet_specs(3, 1)[:2] + [HostSpec("intruder")])
        await o.put_bytes(o.spec.key(fleet["inventory"].key), raw)
    async with WorkflowEnvironment.from_client(await temporal.client()) as env:
        inp = RolloutInput("tiny", "v1", "", origin, manifest=ref, **fleet)
        async with control_worker.build(env.client, [keys["pub_path"]], (ACCESS_KEY, SECRET_KEY)):
            handle = await env.client.start_workflow(RolloutWorkflow.run, inp, id=f"inv-{uuid.uuid4().hex[:6]}",
                                                     task_queue=CONTROL_QUEUE)
            with pytest.raises(WorkflowFailureError) as e:
                await handle.result()
            st = await handle.query(RolloutWorkflow.status)
    assert "host list refused" in str(e.value.cause) and "does not hash to" in str(e.value.cause)
    assert st.phase == "failed" and st.hosts == {} and st.batches == []


async def test_publish_refuses_bad_hosts_with_every_problem_before_touching_anything(tmp_path):
    """Nothing reached: no Temporal client, an origin nobody listens on. The refusal names the host
    list's problems and the rest of the input's together."""
    from weightcast.publish import PublishRequest, publish_and_start
    from weightcast.rollouts import InvalidRolloutInput
    req = PublishRequest(tmp_path, "m", "v1", tmp_path / "absent.pem", OriginSpec("http://127.0.0.1:1", "b", "p"))
    with pytest.raises(InvalidRolloutInput) as e:
        await publish_and_start(None, req, [HostSpec("h0"), HostSpec("h0")], router="http://127.0.0.1:1",
                                max_concurrent_loads=0)
    msg = str(e.value)
    assert msg.startswith("nothing published") and "duplicate host ids: h0" in msg
    assert "needs its model_server" in msg and "max_concurrent_loads" in msg and "inventory." not in msg
