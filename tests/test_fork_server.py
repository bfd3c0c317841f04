"""The host's rank fork server (training/fork_server.py), a real server process: each rank runs in its
own session and logs to its own file, its exit code or signal is reported like a subprocess's, the
matmul peak is measured on request, and a server that dies takes the ranks it watched with it and is
replaced at the next start."""
import asyncio
import json
import os
import signal

from lib.ports import free_ports
from training.config import TrainConfig
from training.fork_server import ForkServer
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


async def test_ranks_fork_into_their_own_sessions_and_report_codes_and_signals(tmp_path):
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


async def test_a_dead_server_takes_its_ranks_with_it_and_the_next_start_forks_from_a_new_one(tmp_path):
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
