"""Golden histories: a history a test just made must replay against today's workflow code, and with
WEIGHTCAST_RECORD_HISTORIES=1 it is kept under tests/histories/ (tests/test_replay.py replays every
one there on each run, so a change that is not replay-safe fails CI)."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

from workers.control_worker import replayer

HISTORIES = Path(__file__).parent / "histories"


async def replays(handle, name: str = "", compress: bool = False) -> None:
    """The history of ``handle`` replays; recorded as ``<name or workflow id>.json[.gz]`` when asked."""
    hist = await handle.fetch_history()
    result = await replayer().replay_workflow(hist, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
    if os.environ.get("WEIGHTCAST_RECORD_HISTORIES"):
        HISTORIES.mkdir(exist_ok=True)
        stem = name or handle.id
        if compress:
            (HISTORIES / f"{stem}.json.gz").write_bytes(gzip.compress(hist.to_json().encode(), mtime=0))
        else:
            (HISTORIES / f"{stem}.json").write_text(hist.to_json())
