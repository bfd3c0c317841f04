"""The dev stack supervises its processes as systemd would: kill -9 peerd on one host, the host worker
on another and the Temporal server mid-rollout; the rollout finishes with no manual step."""
import asyncio
import os
import signal
import time
import uuid

import pytest
from temporalio.service import RPCError

from peerd.signing import KeyError_
from tests.rollout_fixtures import Stack
from tests.test_cli_bench import _pid_of
from tests.test_rollout_faults import RATE, wait_progress
from weightcast.rollouts import start_rollout
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.supervisor import Supervisor


async def test_supervisor_restarts_with_back_off_and_logs(caplog):
    alive, starts = [False], []

    async def is_alive():
        return alive[0]

    async def restart():
        starts.append(time.monotonic())
        if len(starts) < 3:
            raise RuntimeError("still broken")       # fails twice, then stays up
        alive[0] = True
    sup = Supervisor(every=0.02, backoff_min=0.1, backoff_max=0.4).start()
    sup.add("part", is_alive, restart, lambda: "exit code 3")
    for _ in range(200):
        if alive[0]:
            break
        await asyncio.sleep(0.02)
    await sup.stop()
    assert alive[0] and len(starts) == 3 and sup.report()["part"]["restarts"] == 1
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2                # the back-off doubles
    assert "still broken" in sup.report()["part"]["last_error"]
    assert any(r.getMessage() == "restart of part failed" for r in caplog.records)
    assert any(r.getMessage() == "part died (exit code 3); restarting it" for r in caplog.records)   # which, and how


async def test_killed_parts_come_back_and_the_rollout_finishes(tmp_path, seaweed, keys):
    s = await Stack().start(tmp_path, seaweed, keys, ["a", "b"], rate=RATE, supervise=True)
    try:
        handle = await start_rollout(s.client, s.input(heartbeat_timeout_s=5), f"rollout-tiny-v1-{uuid.uuid4().hex[:6]}")
        await wait_progress(s, "a")
        s.stack.peerd["a"].kill()
        s.stack.host_workers["b"].kill()
        temporal = _pid_of(f"--port {s.stack.temporal_port}")
        assert temporal, "the Temporal dev server process"
        os.kill(temporal, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:                               # the server is down for a moment: ride it out
            try:
                result = await handle.result()
                break
            except RPCError:
                assert time.monotonic() < deadline, "the rollout did not finish"
                await asyncio.sleep(1)
        assert result["ready"] == ["a", "b"]
        restarts = s.stack.supervisor.report()
        for part in ("peerd a", "host worker b", "the Temporal server"):
            assert restarts[part]["restarts"] >= 1, restarts
        assert restarts["peerd b"]["restarts"] == 0
    finally:
        await s.stop()


async def test_a_stack_that_fails_to_start_stops_what_it_started(tmp_path, seaweed):
    """A trusted key that is not there, found once the Temporal server and peerd run: the error names
    the key, and no process of the stack is left running."""
    stack = EmbeddedStack(tmp_path / "stack", tmp_path / "missing.pem", ["a"], s3=seaweed)
    with pytest.raises(KeyError_, match="missing.pem not found"):
        await stack.start()
    assert stack.temporal_port and _pid_of(f"--port {stack.temporal_port}") is None
    assert stack.peerd and all(p.proc.poll() is not None for p in stack.peerd.values())
    assert _pid_of(str(tmp_path / "stack")) is None
