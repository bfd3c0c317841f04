"""Automated canary analysis and rollback, against the real dev server, host workers, peerd, model
servers and router: a version that passes its smoke test but answers with errors, and one that answers
slowly, are each rolled back automatically at the first traffic step with the numbers in the history;
a good one passes; `weightcast rollout rollback` moves traffic back to the replaced version."""
import asyncio
import json
import sys
import uuid

import aiohttp
import pytest
from temporalio.client import WorkflowFailureError

from peerd import manifest as mf
from serving.checkpoint import write_checkpoint
from tests.fleet import publish
from tests.golden import replays
from tests.rollout_fixtures import Stack
from tests.serving_fixtures import SMALL
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow
from workflows.types import AnalysisConfig

# The slow fault adds 400 ms. p99 over a 2 s window is the slowest request or two, so one scheduling stall on
# a busy machine can move either version's p99 by 100 ms or more: the thresholds sit far from both.
SLOW_S = 0.4
ANALYSIS = AnalysisConfig(interval_s=2.0, min_requests=10, max_error_rate=0.05, max_error_rate_increase=0.02,
                          max_p99_ratio=2.0, min_p99_increase_ms=150.0, max_inconclusive=2)
CLIENTS = 8                 # concurrent, so that a window holds enough requests to the slow version


async def release(s: Stack, tmp_path, seaweed, keys, version: str, previous: str, **kw):
    src = write_checkpoint(tmp_path / f"ckpt-{version}", SMALL, seed=5, shard_bytes=64 * 1024, version=version)
    m = mf.build_from_directory(src, "tiny", version, chunk_size=64 * 1024)
    inp = s.input(version=version, signed_manifest=json.dumps(mf.sign_manifest(m, keys["private"])),
                  previous_version=previous, **kw)
    inp.origin = await publish(seaweed, src, f"an/{uuid.uuid4().hex[:8]}")
    inp.step_wait_s = 0.0
    return await start_rollout(s.client, inp)


async def traffic(router: str, stop: asyncio.Event) -> int:
    """Clients calling the model through the router all along (what the analysis observes)."""
    async def client(c: aiohttp.ClientSession) -> int:
        sent = 0
        while not stop.is_set():
            async with c.post(f"{router}/v1/models/tiny/infer", json={"input_ids": [[1, 2, 3, 4]]}) as r:
                await r.read()
            sent += 1
            await asyncio.sleep(0.01)
        return sent

    async with aiohttp.ClientSession() as c:
        return sum(await asyncio.gather(*(client(c) for _ in range(CLIENTS))))


async def test_bad_and_slow_versions_roll_back_automatically_a_good_one_passes(tmp_path, seaweed, keys, temporal):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], temporal=temporal)
    stop = asyncio.Event()
    load = None
    try:
        assert (await (await release(s, tmp_path, seaweed, keys, "v1", "", traffic_steps=[100])).result())["ready"]
        load = asyncio.ensure_future(traffic(s.router_addr, stop))
        weights = lambda: s.stack.router.table.models["tiny"].weights      # noqa: E731

        for version, fault, words in [("v2", {"error_every": 3}, "error rate"),
                                      ("v3", {"delay_s": SLOW_S}, "p99 latency")]:
            for server in s.servers.values():       # loads and smoke-tests fine, then serves badly
                server.faults = {("tiny", version): fault}
            handle = await release(s, tmp_path, seaweed, keys, version, "v1", traffic_steps=[50, 100],
                                   analysis=ANALYSIS)
            with pytest.raises(WorkflowFailureError) as e:
                await handle.result()
            assert "analysis failed at 50% (automatic rollback)" in str(e.value.cause) and words in str(e.value.cause)
            st = await handle.query(RolloutWorkflow.status)
            verdict = st.analyses[-1]
            assert verdict["verdict"] == "fail" and verdict["new"]["requests"] >= 10 and verdict["baseline"]["requests"]
            assert weights() == {"v1": 100} or weights().get("v1") == 100
            assert all(("tiny", version) not in srv.versions for srv in s.servers.values())   # discarded everywhere
            await replays(handle, f"canary-rollback-{words.split()[0]}")

        for server in s.servers.values():
            server.faults = {}
        handle = await release(s, tmp_path, seaweed, keys, "v4", "v1", traffic_steps=[50, 100], analysis=ANALYSIS)
        result = await handle.result()
        assert result["traffic"] == {"v4": 100}
        assert [a["verdict"] for a in (await handle.query(RolloutWorkflow.status)).analyses] == ["pass"]

        # on-call: back to the version v4 replaced, through a workflow
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "weightcast.cli", "rollout", "rollback", "tiny", "--reason", "drill",
            "--temporal", s.stack.temporal_addr, "--namespace", s.stack.namespace,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await cli.communicate()
        assert cli.returncode == 0, stderr.decode()[-2000:]
        out = json.loads(stdout.decode().strip().splitlines()[-1])
        assert out["traffic"] == {"v1": 100} and out["from"] == "v4" and out["reason"] == "drill"
        assert weights().get("v1") == 100 and not weights().get("v4")
        await replays(s.client.get_workflow_handle(out["workflow_id"]), "rollback")
        bad = await asyncio.create_subprocess_exec(                  # a name that is not one: refused, not queried
            sys.executable, "-m", "weightcast.cli", "rollout", "rollback", "tiny' OR 'x", "--temporal",
            s.stack.temporal_addr, "--namespace", s.stack.namespace,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, stderr = await bad.communicate()
        assert bad.returncode == 2 and "is not a model name" in stderr.decode()
    finally:
        stop.set()
        if load is not None:
            assert await load > 0
        await s.stop()
