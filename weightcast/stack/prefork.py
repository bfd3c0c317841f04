"""Start the stack's Python daemons by forking them from one process that imported them once.

A fresh interpreter for peerd or a host worker spends about a CPU-second importing aiohttp, botocore,
numpy and temporalio before its first line runs; a stack of N hosts starts 2N of them, and restarts one
after every crash. The fork server here imports those modules once (``python -m weightcast.stack.prefork
MODULE...``); each start is then a fork that runs the module's ``main(argv)`` with its own arguments,
environment, working directory, log and network namespace (a host of a lib/netns.py topology), and the
process title ``ps`` would show for ``python -m``.

The server is one per launching process, started by a thread that lives as long as that process (the
server dies with it, and the daemons with the server: both by PR_SET_PDEATHSIG, as ``child_options``
gives a plain child). It reaps its children and reports each exit status, so a started daemon is
handled as a ``subprocess.Popen`` is: ``poll``, ``wait``, ``send_signal``, ``returncode``.

Wire: JSON lines over a socket pair. Requests ``{"id", "module", "argv", "env", "cwd", "log", "netns"}``;
answers ``{"id", "pid"}`` or ``{"id", "error"}``, and ``{"exited": id, "status"}`` for every child
that ends (status as Popen's returncode: the exit code, or -N for signal N). Exits are keyed by the
request, not the pid: a pid the kernel hands out again is another process."""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback

import setproctitle

from lib.processes import (child_options, describe_exit, exit_code, redirect_to_log, reset_forked_child,
                           set_die_with_parent)

# what the stack forks (peerd, host workers, the rollout-shape benchmark's control worker); a module not
# listed still starts, importing what it needs after the fork
PRELOAD = ("peerd.__main__", "workers.host_worker", "workers.control_worker")


def _main_module(module: str) -> str:
    """The module ``python -m module`` runs: a package's ``__main__``."""
    spec = importlib.util.find_spec(module)
    return f"{module}.__main__" if spec is not None and spec.submodule_search_locations is not None else module


# ---------------------------------------------------------------- the server (its own process)

def _run_child(req: dict, inherited: list[int]) -> None:
    """In the forked child: become the daemon ``req`` asks for, run it, and exit with its code."""
    code, died_of = 1, None
    try:
        reset_forked_child(inherited)
        signal.signal(signal.SIGINT, signal.default_int_handler)     # as a fresh interpreter has it
        set_die_with_parent()
        if req.get("netns"):         # as `ip netns exec` would run it: every socket it opens is in there
            from lib.netns import enter
            enter(req["netns"])
        redirect_to_log(req["log"])
        # `ps` and /proc/PID/cmdline show what `python -m` would have shown (before the environment
        # changes: the title takes the space of the server's own arguments and environment)
        setproctitle.setproctitle(" ".join([sys.executable, "-m", req["module"], *req["argv"]]))
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        main_module = _main_module(req["module"])
        sys.argv = [main_module, *req["argv"]]
        result = importlib.import_module(main_module).main(req["argv"])
        code = 0 if result is None else result
    except SystemExit as e:
        code = exit_code(e)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:    # an interpreter dies of the SIGINT it did not handle
        traceback.print_exc()
        died_of = signal.SIGINT
    except BaseException:        # the daemon's own crash: its traceback goes to its log, as an interpreter's would
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()      # logging's and the daemon's own handlers, as at an interpreter's exit
            sys.stdout.flush()
            sys.stderr.flush()
            if died_of is not None:
                signal.signal(died_of, signal.SIG_DFL)
                os.kill(os.getpid(), died_of)
        finally:
            os._exit(code & 0xFF)


def serve(sock_fd: int, modules: list[str]) -> None:
    for m in modules:
        importlib.import_module(m)
    sock = socket.socket(fileno=sock_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)       # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # a terminal's ^C is for the launching process

    def send(msg: dict) -> None:
        sock.sendall(json.dumps(msg).encode() + b"\n")

    children: dict[int, int] = {}          # pid -> the request that started it

    def reap() -> None:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            send({"exited": children.pop(pid), "status": os.waitstatus_to_exitcode(st)})

    buf = b""
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
            reap()
        if sock in readable:
            data = sock.recv(1 << 16)
            if not data:                   # the launching process is gone: so are we (our children follow)
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    send({"id": req["id"], "error": str(e)})
                    continue
                if pid == 0:
                    _run_child(req, [sock.fileno(), wake_r, wake_w])
                children[pid] = req["id"]
                send({"id": req["id"], "pid": pid})
        reap()                             # a child that ended between the signal and the fork's answer


# ---------------------------------------------------------------- the launching side

class ForkServerError(RuntimeError):
    pass


def _recv(sock: socket.socket) -> bytes:
    """The next bytes from the server; b"" once it is gone (a server that died mid-import resets)."""
    try:
        return sock.recv(1 << 16)
    except ConnectionResetError:
        return b""


class ForkedProcess:
    """A daemon started by the fork server, with the part of ``subprocess.Popen`` the stack uses. Its
    exit status comes from the server, which is its parent."""

    def __init__(self, server: "ForkServer", rid: int, pid: int, args: list[str]):
        self._server, self._rid, self.pid, self.args = server, rid, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self._rid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._server.wait_exit(self._rid, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self._server.status(self._rid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:          # ended just now; the server reports it
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launching side: starts the server on first use, from a thread of its own that then reads
    the server's answers for as long as the process lives."""

    def __init__(self, modules: tuple[str, ...] = PRELOAD, timeout_s: float = 60.0):
        self.modules, self.timeout_s = modules, timeout_s
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._failed: str | None = None
        self._pids: dict[int, int] = {}          # request id -> pid, until the request takes it
        self._running: set[int] = set()          # request ids
        self._errors: dict[int, str] = {}
        self._exited: dict[int, int] = {}        # request id -> status
        self._ids = itertools.count()

    def _start(self) -> None:
        """Under the condition's lock: the thread that starts the server, then reads its answers."""
        self._thread = threading.Thread(target=self._run, name="prefork", daemon=True)
        self._thread.start()
        self._cond.wait_for(lambda: self._sock is not None or self._failed)

    def _run(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "weightcast.stack.prefork", str(theirs.fileno()), *self.modules],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, **child_options(pool_thread=True))
            finally:
                theirs.close()
        except OSError as e:
            with self._cond:
                self._failed = f"the fork server did not start: {e}"
                self._cond.notify_all()
            return
        with self._cond:
            self._sock = ours
            self._cond.notify_all()
        buf = b""
        while data := _recv(ours):
            buf += data
            with self._cond:
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "exited" in msg:
                        self._exited[msg["exited"]] = msg["status"]
                        self._running.discard(msg["exited"])
                    elif "pid" in msg:
                        self._pids[msg["id"]] = msg["pid"]
                        self._running.add(msg["id"])
                    elif "error" in msg:
                        self._errors[msg["id"]] = msg["error"]
                self._cond.notify_all()
        code = proc.wait()
        with self._cond:       # its children got SIGTERM with it (PR_SET_PDEATHSIG); their own statuses are lost
            self._failed = f"the fork server ended ({describe_exit(code)}); see the launching process's stderr"
            for rid in self._running:
                self._exited[rid] = -signal.SIGTERM
            self._running.clear()
            self._cond.notify_all()

    def spawn(self, module: str, argv: list[str], env: dict, log: str, netns: str | None = None) -> ForkedProcess:
        with self._cond:
            if self._thread is None:
                self._start()
            if self._failed:
                raise ForkServerError(self._failed)
            rid = next(self._ids)
        req = {"id": rid, "module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "log": log, "netns": netns}
        with self._send_lock:
            self._sock.sendall(json.dumps(req).encode() + b"\n")
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._pids or rid in self._errors or self._failed,
                                       self.timeout_s):
                raise ForkServerError(f"the fork server did not start {module} within {self.timeout_s:.0f} s")
            if rid in self._errors or rid not in self._pids:
                raise ForkServerError(self._errors.pop(rid, self._failed))
            pid = self._pids.pop(rid)
        return ForkedProcess(self, rid, pid, [sys.executable, "-m", module, *argv])

    def status(self, rid: int) -> int | None:
        with self._cond:
            return self._exited.get(rid)

    def wait_exit(self, rid: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: rid in self._exited, timeout)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def enabled() -> bool:
    """WEIGHTCAST_PREFORK=0 starts each daemon as a fresh interpreter instead."""
    return os.environ.get("WEIGHTCAST_PREFORK", "1") != "0"


def fork_server() -> ForkServer:
    """This process's fork server (started on first use)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ForkServer()
        return _server


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
