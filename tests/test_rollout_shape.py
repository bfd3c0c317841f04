"""The workflow's shape at fleet size: 2,000 hosts against the real dev server, with light activities
standing in for peerd and the model servers (bench/rollout_shape.py: the workflow code, children,
limits and continue-as-new are the real ones). Proves no history nears Temporal's limits, the load cap
holds, and the host list by reference keeps every payload small."""
import json

from bench.rollout_shape import MANIFEST_CHUNKS, history_shape, light_rollout
from tests.golden import replays

HOSTS = 2000
MAX_LOADS = 40


async def test_two_thousand_hosts_within_temporal_limits(tmp_path, seaweed, keys):
    async with light_rollout(tmp_path, seaweed.endpoint, seaweed.bucket, keys, HOSTS, 25, MAX_LOADS,
                             4000) as (client, fleet, wid, result, st, wall):
        assert len(result["ready"]) == HOSTS and fleet.distributed == HOSTS and fleet.loaded == HOSTS
        assert fleet.retried > 0                              # transient failures were retried, not fatal
        assert 1 < fleet.peak_loading <= MAX_LOADS            # the load cap held at fleet size
        assert st.runs > 1 and st.phase == "done"             # the load phase continued-as-new
        shape = await history_shape(client, wid)
        print(json.dumps({"hosts": HOSTS, "manifest_chunks": MANIFEST_CHUNKS,
                          **shape, "peak_loading": fleet.peak_loading, "retried": fleet.retried}))
        assert shape["runs"] == st.runs
        assert shape["longest_history"] < 10_000, f"a history reached {shape['longest_history']} events"
        assert shape["most_activities_in_one_history"] < 2000
        assert shape["largest_history_bytes"] < 8 * 1024 * 1024
        # the manifest (over a MB) and the host list (~100 B a host) travel by reference: the largest
        # payload is the per-host state (a state name a host, in the carry and the result)
        assert shape["largest_payload_bytes"] < 45 * HOSTS


async def test_the_load_phase_continues_as_new_and_each_run_replays(tmp_path, seaweed, keys):
    """A smaller fleet with the smallest history bound: the load phase continues-as-new, the second
    run resumes from the carried state (and reads the host list again), and both runs replay (kept as
    golden histories)."""
    async with light_rollout(tmp_path, seaweed.endpoint, seaweed.bucket, keys, 400, 5, 40,
                             1000) as (client, fleet, wid, result, st, wall):
        assert len(result["ready"]) == 400 and st.runs > 1 and st.phase == "done"
        runs = [wf async for wf in client.list_workflows(f"WorkflowId = '{wid}'")]
        assert len(runs) == st.runs
        for i, wf in enumerate(sorted(runs, key=lambda w: w.start_time), 1):
            await replays(client.get_workflow_handle(wid, run_id=wf.run_id), f"continue-as-new-run-{i}",
                          compress=True)
