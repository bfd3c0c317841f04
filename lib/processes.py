"""Child processes that must not outlive their parent, how they ended, and their logs' last lines."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def set_die_with_parent() -> None:
    """This process gets SIGTERM when its parent (the thread that forked it) ends."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def reset_forked_child(inherited_fds) -> None:
    """In a child forked from a fork server: no signal wakeup fd, SIGCHLD back to its default, and the
    server's own descriptors (its control channel, its wakeup pipe) closed."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited_fds:
        os.close(fd)


def exit_code(e: SystemExit) -> int:
    """The status an interpreter exits with for ``e``: its code, 0 for None, 1 for a message."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def redirect_to_log(path: str | Path) -> None:
    """In a forked child: stdin from /dev/null, stdout and stderr appended to ``path``, as a child
    started with those redirections would have them."""
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)


def child_options(pool_thread: bool = False) -> dict:
    """Popen options for a child that must not outlive its parent (Linux: the kernel sends it SIGTERM
    when the parent dies, even by SIGKILL), so no daemon is left behind by a stopped benchmark or stack.
    The signal follows the *thread* that forked: from the main thread, or (``pool_thread``) from a
    thread that lives as long as the process (asyncio's default executor keeps its threads)."""
    if _prctl is None or (threading.current_thread() is not threading.main_thread() and not pool_thread):
        return {}
    return {"preexec_fn": set_die_with_parent}


def describe_exit(returncode: int | None) -> str:
    """'running', 'exit code N' or 'signal SIGABRT' (Popen reports a signal as -N)."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def last_lines(path: Path, n: int = 12, max_bytes: int = 64 * 1024) -> list[str]:
    """The last lines of a log file (for a report that says why a process died)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError as e:
        return [f"(log unreadable: {e})"]


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    stop_processes([proc], grace)


def stop_processes(procs: list[subprocess.Popen | None], grace: float = 10.0) -> None:
    """SIGTERM to all at once, then SIGKILL to whichever still runs ``grace`` seconds later: a fleet's
    shutdowns overlap instead of queueing one behind another."""
    running = [p for p in procs if p is not None and p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
