"""Where the ranks' own output goes: each spawned rank writes its stdout and stderr (torch's warnings,
library notices, a native abort's stack) into ``rank{N}.log`` in the run's directory instead of the
terminal, and the launcher merges them into ``train.log``: each distinct line once, with the ranks
that printed it (four ranks of an fsdp_tp run all warn about the same DTensor redistribution). A
failed rank's exception still reaches the launcher whole (torch.multiprocessing carries it), and the
launcher adds the tail of that rank's log."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

# torch's per-rank prefix and its glog-style stamp: "[rank3]:W1206 05:09:23.374000 28780 file.py:390] "
_PREFIX = re.compile(r"^(\[rank\d+\]:)?([IWEF])?(\d{4} \d\d:\d\d:\d\d\.\d+ \d+ )?")


def route_rank_logs(out_dir: Path, rank: int) -> Path:
    """This process's fds 1 and 2 (and so sys.stdout, sys.stderr and every native library) into
    ``rank{rank}.log``."""
    path = Path(out_dir) / f"rank{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def merge_rank_logs(out_dir: Path, world_size: int) -> tuple[Path, int]:
    """``train.log``: JSON lines ``{"line", "ranks"}``, each distinct line (stamps removed) once, in
    the order first seen. Returns the path and how many distinct lines it holds."""
    seen: dict[str, list[int]] = {}
    for rank in range(world_size):
        path = Path(out_dir) / f"rank{rank}.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                text = _PREFIX.sub(lambda m: m.group(2) + " " if m.group(2) and m.group(3) else "", line,
                                   count=1).strip()
                if text:
                    seen.setdefault(text, [])
                    if rank not in seen[text]:
                        seen[text].append(rank)
    out = Path(out_dir) / "train.log"
    with open(out, "w") as f:
        for text, ranks in seen.items():
            f.write(json.dumps({"line": text, "ranks": ranks}) + "\n")
    return out, len(seen)


def log_tail(out_dir: Path, rank: int, lines: int = 15) -> str:
    path = Path(out_dir) / f"rank{rank}.log"
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
