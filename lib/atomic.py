"""Files that appear whole or not at all: written beside their final name, then renamed over it."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a part. The
    temporary name is unique per call (several processes may write the same path at once) and is
    removed if the write fails. ``mode``: the file's permissions from its creation (secrets)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
