"""A host's rank fork server: one process that imported torch and the training code once and forks
every supervised rank from itself, so a rank (a restarted one above all) starts in milliseconds and
no host pays torch's import (about 3 CPU-seconds) per rank start; the host worker itself never
imports torch.

The server, ``python -m training.fork_server``, reads tab-separated requests on stdin and answers on
stdout:
- ``rank SPEC LOG``: fork a rank; ``started PID`` once it runs, ``exited PID CODE`` when it ends (CODE
  as ``Popen.returncode``: negative for a signal). Each rank runs in its own session (its process
  group is its pid, for ``killpg``) with stdout and stderr appended to LOG.
- ``export SPEC LOG``: the same for the export of a finished run's weights (SPEC: an ExportInput as
  JSON), so that the host worker that exports does not import torch either.
- ``peak THREADS PRECISION``: this host's matmul FLOP/s with that many CPU threads in that precision
  (the bound of MFU), measured in a forked child so that the server's own threads stay unstarted;
  ``peak THREADS PRECISION VALUE``, or ``failed`` for VALUE.
The server is single-threaded (select on stdin and a SIGCHLD wake-up pipe), so nothing holds a lock
across ``fork``. On end of stdin, its host worker gone, it exits; ranks it forked run on in their
sessions, as ranks of a worker that died always have.

Where many host workers share one machine (a dev stack, the test suite), ``WEIGHTCAST_RANK_ZYGOTE``
names a zygote (training/zygote.py) that forks this same server ready-imported, instead of an
interpreter importing torch for every host.

``ForkServer`` is the host worker's side: ``start(spec, log)`` returns a ``ForkedRank`` with the
``pid``, ``returncode``, ``wait()`` and ``kill()`` of a subprocess, ``peak(threads, precision)`` the
measured bound. If the server itself dies, the ranks it was watching can no longer be watched: they
are killed and reported as killed, and the next request starts a fresh server.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import signal
import sys
import traceback
from pathlib import Path

from lib.processes import exit_code, redirect_to_log, reset_forked_child
from training.zygote import ENV as ZYGOTE_ENV, ZygoteError, spawn as spawn_from_zygote

logger = logging.getLogger(__name__)


def _run(kind: str, spec: str) -> None:
    if kind == "rank":
        from training.supervised_rank import run_spec
        run_spec(spec)                  # leaves with os._exit(0) once the rank is done
    else:
        from training.export import export_spec
        export_spec(spec)


def _fork_child(kind: str, spec: str, log: str, wake_fds: tuple[int, int]) -> int:
    """Fork one rank (or export); in the child, run it and never return. Returns once the child leads
    its own session, so whoever gets the pid can signal its process group."""
    in_session_r, in_session_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(in_session_w)
        os.read(in_session_r, 1)            # end of file: the child has called setsid (or died)
        os.close(in_session_r)
        return pid
    code = 1
    try:
        os.setsid()
        os.close(in_session_r)
        os.close(in_session_w)
        reset_forked_child(wake_fds)
        redirect_to_log(log)
        _run(kind, spec)
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_peak(threads: int, precision: str, wake_fds: tuple[int, int]) -> int:
    """Fork a child that measures the matmul peak and writes its answer line to stdout."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        reset_forked_child(wake_fds)
        import torch
        from training.flops import matmul_peak
        from training.rank import device_for
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        value = matmul_peak(device_for(0), dtype, threads, 0.3)
        os.write(1, f"peak {threads} {precision} {value!r}\n".encode())
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    from training.supervised_rank import preload
    preload()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)     # a handler, so the wake-up byte is written
    children: set[int] = set()
    measuring: dict[int, str] = {}          # pid -> "THREADS PRECISION"
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        while children or measuring:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            if pid in measuring:
                asked = measuring.pop(pid)
                if os.waitstatus_to_exitcode(status):
                    os.write(1, f"peak {asked} failed\n".encode())
                continue
            children.discard(pid)
            os.write(1, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:                 # the host worker is gone
                os._exit(0)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                kind, *args = line.decode().split("\t")
                if kind in ("rank", "export"):
                    pid = _fork_child(kind, args[0], args[1], (wake_r, wake_w))
                    children.add(pid)
                    os.write(1, f"started {pid}\n".encode())
                else:
                    threads, precision = int(args[0]), args[1]
                    measuring[_fork_peak(threads, precision, (wake_r, wake_w))] = f"{threads} {precision}"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ForkedRank:
    """A rank forked by the server, watched like a subprocess."""

    def __init__(self, pid: int, exited: asyncio.Future):
        self.pid, self._exited = pid, exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)      # a timed-out wait must not cancel the watch

    def kill(self) -> None:
        """SIGKILL the rank's process group (the rank and anything it started)."""
        _kill_group(self.pid)


class ForkServer:
    """The host worker's handle on its fork server, started by ``warm_soon`` or the first request."""

    def __init__(self, log: Path):
        self.log = log
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._starting: collections.deque[asyncio.Future] = collections.deque()
        self._exits: dict[int, asyncio.Future] = {}
        self._peaks: dict[tuple[int, str], list[asyncio.Future]] = {}
        self._spawning = asyncio.Lock()
        self._warming: asyncio.Future | None = None      # held: a task nobody references can be collected

    def warm_soon(self) -> None:
        """Start the server now, from a running loop, without waiting: its imports overlap whatever
        comes before the first rank."""
        self._warming = asyncio.ensure_future(self._running())

    async def start(self, spec: Path, log: Path, kind: str = "rank") -> ForkedRank:
        """Fork a rank (``kind`` "rank": training.supervised_rank's SPEC) or an export of a finished run
        ("export": training.export's SPEC, an ExportInput)."""
        started = asyncio.get_running_loop().create_future()
        self._starting.append(started)
        await self._send(f"{kind}\t{spec}\t{log}")
        pid = await started
        return ForkedRank(pid, self._exits[pid])

    async def peak(self, threads: int, precision: str) -> float:
        """Matmul FLOP/s with ``threads`` CPU threads in ``precision`` (0.0 if it could not be measured)."""
        answer = asyncio.get_running_loop().create_future()
        asked = self._peaks.setdefault((threads, precision), [])
        asked.append(answer)
        if len(asked) == 1:              # one measurement at a time per setting: two would slow each other
            await self._send(f"peak\t{threads}\t{precision}")
        return await answer

    async def _running(self) -> None:
        async with self._spawning:
            if self._proc is None or self._reader.done():
                await self._spawn()

    async def _send(self, line: str) -> None:
        await self._running()
        self._proc.stdin.write(f"{line}\n".encode())
        await self._proc.stdin.drain()

    async def _spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._proc = None
        zygote = os.environ.get(ZYGOTE_ENV)
        if zygote:                       # many host workers on one machine: forked ready-imported
            try:
                self._proc = await spawn_from_zygote(zygote, self.log)
            except (OSError, ZygoteError) as e:
                logger.warning("rank zygote unusable, starting the fork server itself",
                               extra={"zygote": zygote, "error": str(e)})
        if self._proc is None:
            with open(self.log, "ab") as err:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "training.fork_server", stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True)
        self._reader = asyncio.create_task(self._read(self._proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Until the server's stdout ends. Cancelled (its worker stopping), it leaves the ranks running,
        as a worker's ranks always outlive it; the server exits when the worker's end of stdin closes."""
        loop = asyncio.get_running_loop()
        async for line in proc.stdout:
            kind, pid, *code = line.decode().split()
            if kind == "peak":
                threads, precision, value = int(pid), code[0], code[1]
                for answer in self._peaks.pop((threads, precision), []):
                    if not answer.done():
                        answer.set_result(0.0 if value == "failed" else float(value))
            elif kind == "started":
                self._exits[int(pid)] = loop.create_future()
                started = self._starting.popleft()
                if started.cancelled():             # its activity was cancelled meanwhile: no one runs it
                    _kill_group(int(pid))
                else:
                    started.set_result(int(pid))
            else:
                self._exits.pop(int(pid)).set_result(int(code[0]))
        await proc.wait()
        gone = RuntimeError(f"the rank fork server exited with {proc.returncode} (its log: {self.log})")
        waiting = [*self._starting, *(a for answers in self._peaks.values() for a in answers)]
        self._starting.clear()
        self._peaks.clear()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(gone)
        for pid, exited in self._exits.items():        # no one can report their end any more
            _kill_group(pid)
            exited.set_result(-signal.SIGKILL)
        self._exits.clear()

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.stdin.close()
            await self._reader


if __name__ == "__main__":
    serve()
