"""One rank under ``torchrun`` (the baseline ``bench train-recovery`` compares against): the same
rank code, model, data and checkpoints as a supervised rank; torchrun's agent restarts every worker
when one dies, and they resume from the newest complete checkpoint.

``python -m torch.distributed.run --nproc-per-node N --max-restarts R ... -m training.torchrun_rank SPEC``
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

from training.rank import leave, run_rank


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(spec["out_dir"]) / f"restart-{restart}" / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    faulthandler.enable()
    # one node: the ranks of each restart meet through a fresh file (the agent's TCP store kept keys of
    # the killed round that gloo's new groups then tried to connect to: "connection refused")
    init = f"file://{Path(spec['out_dir']).resolve()}/rendezvous-{restart}"
    alive = run_rank(rank, spec["config"], str(out), {**spec["durable"], "init_method": init,
                                             "progress": str(out / "progress.json")})
    leave(alive)


if __name__ == "__main__":
    main()
