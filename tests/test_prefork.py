"""Daemons forked from the stack's fork server behave as the fresh interpreters they replace: their
own arguments, environment, working directory, log and `ps` line; exit codes, signals and crashes
reported as Popen reports them; none outlives the server."""
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from weightcast.stack.prefork import ForkServer, ForkServerError, ForkedProcess
from tests.waiting import until_sync


@pytest.fixture
def server():
    return ForkServer(modules=("tests.prefork_child",))


def start(server, tmp_path, *args, env=None, netns=None):
    out = tmp_path / "started.json"
    out.unlink(missing_ok=True)
    proc = server.spawn("tests.prefork_child", [str(out), *args], {**os.environ, **(env or {})},
                        str(tmp_path / "child.log"), netns)
    until_sync(out.exists, 30, "the child's record")
    return proc, json.loads(out.read_text())


def test_a_forked_daemon_gets_its_own_arguments_environment_directory_and_ps_line(server, tmp_path, monkeypatch):
    start(server, tmp_path, "exit", "0")          # the server runs (from the test's directory, where `tests` is)
    monkeypatch.chdir(tmp_path)
    proc, seen = start(server, tmp_path, "exit", "3", env={"PREFORK_TEST": "given"})
    assert isinstance(proc, ForkedProcess) and seen["pid"] == proc.pid
    assert seen["argv"][1:] == ["exit", "3"] and seen["env"] == "given" and seen["cwd"] == str(tmp_path)
    assert seen["cmdline"] == f"{sys.executable} -m tests.prefork_child {tmp_path / 'started.json'} exit 3"
    assert proc.wait(30) == 3 and proc.poll() == 3 and proc.returncode == 3
    assert "started with" in (tmp_path / "child.log").read_text()


def test_exits_by_signal_and_by_crash_read_as_popen_reads_them(server, tmp_path):
    proc, _ = start(server, tmp_path, "wait")
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()                                  # a second signal to an ended process is a no-op
    interrupted, _ = start(server, tmp_path, "wait")
    interrupted.send_signal(signal.SIGINT)        # Python's own handler, as in a fresh interpreter
    assert interrupted.wait(30) == -signal.SIGINT
    assert "KeyboardInterrupt" in (tmp_path / "child.log").read_text()
    negative, _ = start(server, tmp_path, "exit", "-1")
    assert negative.wait(30) == 255                # as `sys.exit(-1)` ends an interpreter, not a signal
    crashed, _ = start(server, tmp_path, "raise")
    assert crashed.wait(30) == 1
    assert "ValueError: the daemon's own crash" in (tmp_path / "child.log").read_text()


def test_the_daemons_end_with_the_server_and_a_dead_server_says_so(server, tmp_path):
    proc, _ = start(server, tmp_path, "wait")
    server_pid = int(subprocess.run(["ps", "-o", "ppid=", "-p", str(proc.pid)], capture_output=True,
                                    text=True, check=True).stdout)
    os.kill(server_pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGTERM      # the kernel's PR_SET_PDEATHSIG, as for a plain child
    until_sync(lambda: not os.path.exists(f"/proc/{proc.pid}"), 30, "the daemon gone")
    with pytest.raises(ForkServerError, match="fork server ended"):
        server.spawn("tests.prefork_child", [str(tmp_path / "x"), "exit", "0"], dict(os.environ),
                     str(tmp_path / "x.log"))


def test_a_module_proc_restarts_through_the_fork_server(tmp_path, keys):
    """A stack's peerd, killed and started again: each start a fork, each ready."""
    from lib.ports import free_ports
    from weightcast.stack.peerd_proc import PeerdProc
    p = PeerdProc("a", free_ports(1)[0], tmp_path / "a" / "store", ["--trusted-key", str(keys["pub_path"])])
    try:
        for _ in range(2):
            p.start()
            assert isinstance(p.proc, ForkedProcess) and p.running
            p.kill()
            assert p.death()["how"] == "signal SIGKILL"
    finally:
        p.stop()


def test_a_server_that_cannot_import_its_modules_fails_the_start_at_once(tmp_path):
    server = ForkServer(modules=("weightcast.no_such_module",))
    with pytest.raises(ForkServerError, match="fork server ended"):
        server.spawn("tests.prefork_child", [str(tmp_path / "x"), "exit", "0"], dict(os.environ), str(tmp_path / "x.log"))


def test_a_daemon_forked_into_a_network_namespace_runs_there(server, tmp_path):
    """As ``ip netns exec NS`` would run it: a stack's host on a kernel network (lib/netns.py)."""
    ns = f"wc-prefork-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        proc, seen = start(server, tmp_path, "exit", "0", netns=ns)
        assert proc.wait(30) == 0
        assert seen["netns"] == os.stat(f"/run/netns/{ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=True)
