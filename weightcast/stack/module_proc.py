"""A Python module run as a child process that signals readiness by writing a file (peerd, host workers)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lib.processes import child_options, describe_exit, last_lines, stop_process
from weightcast.stack import prefork


@dataclass
class ModuleProc:
    name: str                      # for logs and errors: "peerd a", "host worker a"
    module: str                    # run as `python -m <module> <args> --ready-file <workdir>/<slug>.ready`
    workdir: Path                  # holds <slug>.log and <slug>.ready
    args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | prefork.ForkedProcess | None = None
    netns: str | None = None       # run it inside this network namespace (a lib/netns.py host's)

    @property
    def _slug(self) -> str:
        return self.name.replace(" ", "-")

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self._slug}.log"

    def start(self, timeout: float = 30.0) -> "ModuleProc":
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> "ModuleProc":
        """Start without waiting (start several, then wait for each)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ready = self.workdir / f"{self._slug}.ready"
        self._ready.unlink(missing_ok=True)
        args = [*self.args, "--ready-file", str(self._ready)]
        if prefork.enabled():          # forked from a process that imported it once
            self.proc = prefork.fork_server().spawn(self.module, args, {**os.environ, **self.env}, str(self.log_path),
                                                    self.netns)
            return self
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd = [*prefix, sys.executable, "-m", self.module, *args]
        with open(self.log_path, "ab") as log:   # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         **child_options())
        return self

    def wait_ready(self, timeout: float = 30.0) -> "ModuleProc":
        deadline = time.monotonic() + timeout
        while not self._ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {timeout}s; see {self.log_path}")
            time.sleep(0.05)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def death(self, lines: int = 40) -> dict | None:
        """None while running; else how it ended and the last lines of its log."""
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = last_lines(self.log_path, 10 * lines)
        # a crash dump (faulthandler) lists every thread: show it from its header, which a busy
        # daemon's threads would push out of the last lines
        fatal = [i for i, line in enumerate(tail) if line.startswith("Fatal Python error")]
        shown = tail[fatal[-1]:fatal[-1] + lines] if fatal else tail[-lines:]
        return {"process": self.name, "how": describe_exit(self.proc.returncode),
                "log": str(self.log_path), "last_log_lines": shown}

    def kill(self) -> None:
        """SIGKILL: the crash the system must survive."""
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)
