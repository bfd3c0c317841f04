"""The host's rank fork server (training/fork_server.py), a real server process: each rank runs in its
own session and logs to its own file, its exit code or signal is reported like a subprocess's, the
matmul peak is measured on request, and a server that dies takes the ranks it watched with it and is
replaced at the next start."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.training import TrainingActivities
from lib.ports import free_ports
from training.config import TrainConfig
from training.fork_server import ForkServer
from training.zygote import ENV as ZYGOTE_ENV
from workflows.training_types import ExportInput
from tests.waiting import until


def waiting_rank(tmp_path, name: str) -> tuple:
    """Rank 0 of a world of two whose peer never comes: it waits in the rendezvous, using no CPU."""
    port = free_ports(1)[0]
    d = tmp_path / name
    d.mkdir()
    spec = d / "spec.json"
    spec.write_text(json.dumps({"rank": 0, "config": TrainConfig(world_size=2).to_dict(), "out_dir": str(d),
                                "durable": {"init_method": f"tcp://127.0.0.1:{port}", "checkpoints": str(d / "ckpt"),
                                            "every": 5, "progress": str(d / "progress.json"),
                                            "collective_timeout_s": 120}}))
    return spec, d / "rank.log"


@pytest.fixture(params=["exec", "zygote"])
def started(request, monkeypatch):
    """The server as a real host starts it (an interpreter of its own), and forked by the run's zygote
    (training/zygote.py), as the hosts of one machine start it."""
    monkeypatch.delenv(ZYGOTE_ENV, raising=False)
    if request.param == "zygote":
        request.getfixturevalue("rank_zygote")
    return request.param


async def test_ranks_fork_into_their_own_sessions_and_report_codes_and_signals(tmp_path, started):
    forks = ForkServer(tmp_path / "fork-server.log")
    try:
        broken = await forks.start(tmp_path / "missing.json", tmp_path / "broken.log")
        assert await broken.wait() == 1 and broken.returncode == 1
        assert "FileNotFoundError" in (tmp_path / "broken.log").read_text()     # its traceback, in its log

        spec, log = waiting_rank(tmp_path, "a")
        rank = await forks.start(spec, log)
        assert os.getpgid(rank.pid) == rank.pid and os.getsid(rank.pid) == rank.pid
        try:                                 # a timed-out wait leaves the rank watched
            await asyncio.wait_for(rank.wait(), timeout=0.2)
            raise AssertionError("the waiting rank exited")
        except asyncio.TimeoutError:
            pass
        assert rank.returncode is None
        os.killpg(rank.pid, signal.SIGTERM)
        assert await rank.wait() == -signal.SIGTERM
        # the bound of MFU, measured in a child of the server: a positive FLOP rate per precision
        assert await forks.peak(1, "fp32") > 1e6 and await forks.peak(1, "bf16") > 1e6
        together = await asyncio.gather(forks.peak(1, "fp32"), forks.peak(1, "fp32"))    # one answer for both
        assert together[0] == together[1] > 1e6
    finally:
        await forks.close()


async def test_a_dead_server_takes_its_ranks_with_it_and_the_next_start_forks_from_a_new_one(tmp_path, started):
    forks = ForkServer(tmp_path / "fork-server.log")
    try:
        spec, log = waiting_rank(tmp_path, "a")
        rank = await forks.start(spec, log)
        first = forks._proc.pid
        os.kill(first, signal.SIGKILL)
        assert await asyncio.wait_for(rank.wait(), 30) == -signal.SIGKILL
        await until(lambda: not os.path.exists(f"/proc/{rank.pid}"), 30, "the orphaned rank gone")

        again = await forks.start(tmp_path / "missing.json", tmp_path / "broken.log")
        assert forks._proc.pid != first and await again.wait() == 1
    finally:
        await forks.close()


# a host worker's side, run in a network namespace by `ip netns exec`: its fork server's pid, and the
# namespace, directory, session and title that server runs with
_CLIENT = """
import asyncio, json, os, sys
from pathlib import Path
from training.fork_server import ForkServer
async def main():
    forks = ForkServer(Path(sys.argv[1]))
    await forks.peak(1, "fp32")              # any request starts the server
    pid = forks._proc.pid
    print(json.dumps({"pid": pid, "netns": os.stat(f"/proc/{pid}/ns/net").st_ino, "cwd": os.readlink(f"/proc/{pid}/cwd"),
                      "sid": os.getsid(pid),
                      "cmdline": open(f"/proc/{pid}/cmdline").read()}), flush=True)
    await forks.close()
    print(json.dumps({"status": forks._proc.returncode}), flush=True)
asyncio.run(main())
"""


def test_a_zygote_forks_each_host_workers_server_in_that_workers_namespace_directory_and_session(
        tmp_path, rank_zygote):
    ns = f"wcz{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _CLIENT, str(tmp_path / "fs.log")],
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()},
                             capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
        seen, ended = json.loads(out[0]), json.loads(out[1])
        assert seen["netns"] == os.stat(f"/run/netns/{ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=True)
    assert seen["cwd"] == str(tmp_path) and seen["sid"] == seen["pid"]
    assert seen["cmdline"].startswith(f"{sys.executable} -m training.fork_server")
    assert ended["status"] == 0                   # its host worker's pipe closed: it exited, and the zygote said so


async def test_a_zygote_forked_server_and_its_ranks_have_the_host_workers_environment(tmp_path, rank_zygote,
                                                                                       monkeypatch):
    """A rank that rendezvouses by ``env://`` reads MASTER_ADDR and MASTER_PORT, which only this worker's
    environment has: rank 0 listens on that port (without them, it would fail at once)."""
    port = free_ports(1)[0]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    spec, log = waiting_rank(tmp_path, "a")
    s = json.loads(spec.read_text())
    s["durable"]["init_method"] = "env://"
    spec.write_text(json.dumps(s))
    forks = ForkServer(tmp_path / "fork-server.log")
    try:
        rank = await forks.start(spec, log)

        def listening() -> bool:
            assert rank.returncode is None, log.read_text()
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0
        await until(listening, 60, "rank 0 listening on the worker's MASTER_PORT")
        rank.kill()
        assert await rank.wait() == -signal.SIGKILL
    finally:
        await forks.close()


async def test_a_zygote_that_cannot_be_reached_leaves_the_worker_to_start_its_server_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(ZYGOTE_ENV, str(tmp_path / "no-such.sock"))
    forks = ForkServer(tmp_path / "fork-server.log")
    try:
        broken = await forks.start(tmp_path / "missing.json", tmp_path / "broken.log")
        assert await broken.wait() == 1
        assert isinstance(forks._proc, asyncio.subprocess.Process)      # an interpreter of its own
    finally:
        await forks.close()


async def test_an_export_with_nothing_to_export_fails_with_its_reason(tmp_path, rank_zygote):
    acts = TrainingActivities("h0", tmp_path / "train")
    inp = ExportInput("r1", TrainConfig().to_dict(), str(tmp_path / "ckpt"), str(tmp_path / "out"), "v1")
    try:
        with pytest.raises(ApplicationError) as e:
            await ActivityEnvironment().run(acts.export_weights, inp)
    finally:
        await acts.forks.close()
    assert e.value.type == "ExportFailed" and "exit code 1" in str(e.value)
    assert "no complete checkpoint under" in str(e.value) and "nothing to export" in str(e.value)
