"""One rank of a supervised training run, as its own process: ``python -m training.supervised_rank SPEC``.

The host's ``train_rank`` activity (activities/training.py) writes SPEC — ``{"rank", "config",
"out_dir", "durable"}`` — starts this process and watches the progress file it rewrites every step.
Exit status 0 means the run reached its last step (or paused) with that state checkpointed.

``--warm``: import torch and the training code now, then wait for a SPEC path on stdin. A host keeps
one such process ready so that a restarted rank does not pay the interpreter's and torch's start-up
(most of a restart on small models) after a failure.
"""
from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import time
from pathlib import Path

from training.rank import leave, run_rank


def _run(spec_path: str) -> None:
    t_spec = time.time()
    spec = json.loads(Path(spec_path).read_text())
    spec["durable"]["t_spec"] = t_spec           # the start of this rank's start-up timeline (progress)
    faulthandler.enable()            # a native abort in a collective still names the Python line
    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    alive = run_rank(spec["rank"], spec["config"], spec["out_dir"], spec["durable"])   # held until exit
    leave(alive)


def _preload() -> None:
    """Import what a rank would otherwise import lazily after a failure: DDP's constructor imports
    torch._dynamo (0.5-0.9 s here, most of a small model's restart), checkpoint loading imports DCP's
    state-dict helpers."""
    for name in ("torch._dynamo", "torch.distributed.checkpoint.state_dict", "torch.nn.parallel"):
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if args and args[0] == "--warm":
        _preload()
        line = sys.stdin.readline().strip()
        if not line:                 # the host worker went away before using us
            os._exit(0)
        spec, log = line.split("\t")
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        _run(spec)
    _run(args[0])


if __name__ == "__main__":
    main()
