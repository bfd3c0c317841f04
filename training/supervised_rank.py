"""One rank of a supervised training run, as its own process: ``python -m training.supervised_rank SPEC``.

The host's ``train_rank`` activity (activities/training.py) writes SPEC — ``{"rank", "config",
"out_dir", "durable"}`` — and has its fork server (training/fork_server.py) fork a process that runs
``run_spec``, then watches the progress file the rank rewrites every step. Exit status 0 means the
run reached its last step (or paused) with that state checkpointed.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import sys
import time
from pathlib import Path

from training.rank import RANK_IMPORTS, leave, run_rank


def run_spec(spec_path: str) -> None:
    t_spec = time.time()
    spec = json.loads(Path(spec_path).read_text())
    spec["durable"]["t_spec"] = t_spec           # the start of this rank's start-up timeline (progress)
    faulthandler.enable()            # a native abort in a collective still names the Python line
    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    alive = run_rank(spec["rank"], spec["config"], spec["out_dir"], spec["durable"])   # held until exit
    leave(alive)


def preload() -> None:
    """Import what a rank would otherwise import lazily (``training.rank.RANK_IMPORTS``). A host's
    fork server starts before any run's config is known, so a Llama-family rank still imports
    transformers' modeling code itself."""
    for name in RANK_IMPORTS:
        importlib.import_module(name)


if __name__ == "__main__":
    run_spec(sys.argv[1])
