"""One rank of a supervised training run, as its own process: ``python -m training.supervised_rank SPEC``.

The host's ``train_rank`` activity (activities/training.py) writes SPEC — ``{"rank", "config",
"out_dir", "durable"}`` — starts this process and watches the progress file it rewrites every step.
Exit status 0 means the run reached its last step and the final checkpoint is complete.
"""
from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

from training.rank import leave, run_rank


def main(argv: list[str] | None = None) -> None:
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    faulthandler.enable()            # a native abort in a collective still names the Python line
    Path(spec["out_dir"]).mkdir(parents=True, exist_ok=True)
    run_rank(spec["rank"], spec["config"], spec["out_dir"], spec["durable"])
    leave()


if __name__ == "__main__":
    main()
