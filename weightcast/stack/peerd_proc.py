"""Start real peerd processes on loopback (the benchmark, the tests and `weightcast dev up` use this)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from weightcast.stack.processes import stop_process


@dataclass
class PeerdProc:
    id: str
    port: int
    store: Path
    args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "PeerdProc":
        ready = self.store.parent / f"{self.id}.ready"
        ready.unlink(missing_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "peerd", "--id", self.id, "--store", str(self.store),
               "--port", str(self.port), "--ready-file", str(ready), *self.args]
        with open(self.store.parent / f"{self.id}.log", "ab") as log:   # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"peerd {self.id} exited with {self.proc.returncode}; see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"peerd {self.id} not ready in {timeout}s")
            time.sleep(0.05)
        json.loads(ready.read_text())
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)


def fleet_args(me: str, ports: dict[str, int], *, token: str, trusted_key: Path, rate: float | None,
               origin_rate: float | None, rack: str = "", extra: list[str] = ()) -> list[str]:
    args = ["--token", token, "--trusted-key", str(trusted_key), "--rack", rack,
            "--upload-rate", str(rate or 0), "--download-rate", str(rate or 0), "--origin-rate", str(origin_rate or 0)]
    for other, port in ports.items():
        if other != me:
            args += ["--peer", f"{other}=http://127.0.0.1:{port}@{rack}"]
    return args + list(extra)
