"""Rank fork servers for many host workers on one machine, forked ready-imported.

A host worker starts its rank fork server (training/fork_server.py), which imports torch, the
training code and transformers' Llama-family modeling code: about 4.5 CPU-seconds here. A host of a
real fleet pays that once. A dev stack, a test suite or a benchmark runs many host workers on one
machine, and would pay it for every host it starts.

The zygote, ``python -m training.zygote SOCKET``, imports all of that once and listens on a Unix
socket (``Zygote`` starts one; so does a stack whose hosts train, weightcast/stack/embedded.py). A
host worker whose environment names the socket (``WEIGHTCAST_RANK_ZYGOTE``) has it fork its fork
server instead of starting an interpreter: the same server, with the same pipes to its host worker
and the same log, in the worker's working directory, environment and network namespace, in a
session of its own, titled as ``python -m training.fork_server`` would be. Nothing else
changes: the server still exits when its host worker's end of the pipe closes, and its ranks still
outlive it. A host worker without the variable, or whose zygote cannot be reached, execs the server.

Wire, per host worker, one connection: the worker sends an 8-byte length and a JSON object
``{"cwd", "env"}`` with four descriptors (the server's stdin, stdout, stderr and the worker's network
namespace); the zygote answers ``{"pid"}`` (or ``{"error"}``) and later ``{"status"}`` (as
``Popen.returncode``) when the server ends, then closes the connection.
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ENV = "WEIGHTCAST_RANK_ZYGOTE"
_HEADER = struct.Struct("!Q")


class ZygoteError(RuntimeError):
    pass


# ---------------------------------------------------------------- the zygote (its own process)

def _run_server(req: dict, fds: list[int], inherited: list[int]) -> None:
    """In the forked child: become the host worker's fork server, and exit when it does."""
    code = 1
    try:
        from lib.netns import enter_fd
        from lib.processes import exit_code, reset_forked_child, set_die_with_parent
        reset_forked_child(inherited)
        signal.signal(signal.SIGINT, signal.default_int_handler)     # as a fresh interpreter has it
        set_die_with_parent()
        os.setsid()
        stdin, stdout, stderr, netns = fds
        enter_fd(netns)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        import setproctitle
        setproctitle.setproctitle(f"{sys.executable} -m training.fork_server")
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        from training.fork_server import serve
        serve()
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code & 0xFF)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    try:
        while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
            more = conn.recv(1 << 16)
            if not more:
                raise ZygoteError("the host worker hung up mid-request")
            data += more
        if len(fds) != 4:
            raise ZygoteError(f"expected 4 descriptors, got {len(fds)}")
        return json.loads(data[_HEADER.size:]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def serve(path: str) -> None:
    from training.rank import HF_MODEL_IMPORTS, RANK_IMPORTS
    for name in (*RANK_IMPORTS, *HF_MODEL_IMPORTS):
        importlib.import_module(name)
    import setproctitle            # noqa: F401  (the children set their titles with it)
    gc.freeze()                    # what is imported stays shared with every child: no collection writes to it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)        # the path appears only once it accepts connections
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)       # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # a terminal's ^C is for whoever started us
    children: dict[int, socket.socket] = {}               # the server's pid -> its host worker's connection

    def tell(conn: socket.socket, msg: dict) -> None:
        try:
            conn.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:            # that host worker is gone: nobody is left to tell
            pass

    def reap() -> None:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            conn = children.pop(pid)
            tell(conn, {"status": os.waitstatus_to_exitcode(status)})
            conn.close()

    print("ready", flush=True)
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r, 0], [], [])
        except InterruptedError:
            continue
        if 0 in readable and not os.read(0, 4096):       # whoever started us is gone: so are we
            return
        if wake_r in readable:
            os.read(wake_r, 4096)
            reap()
        if listener in readable:
            conn, _ = listener.accept()
            conn.settimeout(10)
            try:
                req, fds = _receive(conn)
            except (OSError, ValueError, ZygoteError) as e:
                tell(conn, {"error": f"{type(e).__name__}: {e}"})
                conn.close()
                continue
            try:
                pid = os.fork()
            except OSError as e:
                pid = -1
                tell(conn, {"error": f"fork: {e}"})
            if pid == 0:
                _run_server(req, fds, [listener.fileno(), wake_r, wake_w, conn.fileno(),
                                       *(c.fileno() for c in children.values())])
            for fd in fds:             # the server's now, or nobody's
                os.close(fd)
            if pid < 0:
                conn.close()
                continue
            children[pid] = conn
            tell(conn, {"pid": pid})
        reap()


# ---------------------------------------------------------------- who starts it

class Zygote:
    """A zygote this process starts: ``env()`` points host workers at it, ``stop()`` ends it (the fork
    servers it forked end with it) and removes its socket. It also ends when this process does: its
    stdin is ours (and, started from the main thread, PR_SET_PDEATHSIG)."""

    def __init__(self, log: Path | None = None, timeout_s: float = 120):
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        # a socket's path has at most 107 bytes: a short directory of its own, not the caller's
        self.dir = tempfile.mkdtemp(prefix="wc-zygote-")
        self.path = os.path.join(self.dir, "zygote.sock")
        self.log = Path(log) if log else Path(self.dir, "zygote.log")

    def start(self, wait: bool = True) -> "Zygote":
        """Returns once it listens (its imports take a few CPU-seconds), or at once (``wait=False``):
        its socket's path then appears once it listens."""
        from lib.processes import child_options, last_lines
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "training.zygote", self.path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, **child_options())
        if not wait:
            return self
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready or self.proc.stdout.readline() != b"ready\n":
            self.stop()
            raise ZygoteError(f"the rank zygote did not start: {' | '.join(last_lines(self.log))}")
        return self

    def env(self) -> dict[str, str]:
        return {ENV: self.path}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()              # it exits at the end of its stdin
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- the host worker's side

class ZygoteServer:
    """A fork server forked by a zygote, with what ``training.fork_server.ForkServer`` uses of an
    ``asyncio.subprocess.Process``: ``pid``, ``stdin``, ``stdout``, ``wait()``, ``returncode``."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader,
                 status: tuple[asyncio.StreamReader, asyncio.StreamWriter]):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._status, self._connection = status     # the writer held: collected, it would close the connection

    async def wait(self) -> int:
        if self.returncode is None:
            line = await self._status.readline()
            # a zygote that died cannot tell: the server died with it (PR_SET_PDEATHSIG)
            self.returncode = json.loads(line)["status"] if line else -signal.SIGTERM
            self._connection.close()
        return self.returncode


async def spawn(path: str, log: Path) -> ZygoteServer:
    """Have the zygote at ``path`` fork a fork server for this process, logging to ``log``."""
    loop = asyncio.get_running_loop()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        body = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        await asyncio.to_thread(_request, sock, path, _HEADER.pack(len(body)) + body, [in_r, out_w, err, netns])
    except BaseException:
        sock.close()
        for fd in (in_w, out_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err, netns):
            os.close(fd)
    sock.setblocking(False)
    status, connection = await asyncio.open_unix_connection(sock=sock)
    answer = json.loads(await status.readline() or b'{"error": "the zygote hung up"}')
    if "pid" not in answer:
        connection.close()
        os.close(in_w)
        os.close(out_r)
        raise ZygoteError(f"the rank zygote at {path} could not fork a fork server: {answer['error']}")
    stdout = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(out_r, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                         os.fdopen(in_w, "wb", 0))
    return ZygoteServer(answer["pid"], asyncio.StreamWriter(transport, protocol, None, loop), stdout,
                        (status, connection))


def _request(sock: socket.socket, path: str, message: bytes, fds: list[int]) -> None:
    sock.connect(path)
    sent = socket.send_fds(sock, [message], fds)
    if sent < len(message):
        sock.sendall(message[sent:])


if __name__ == "__main__":
    serve(sys.argv[1])
