"""Bytes a rank process has put on the wire: the kernel's own count (``tcp_info.bytes_sent``, read with
``ss``) over the process's open TCP sockets. It counts every layout's collectives alike, torch's own
(FSDP, tensor and pipeline parallelism) as much as weightcast's DDP hooks, plus the small store
traffic; read before the process group closes its connections."""
from __future__ import annotations

import re
import subprocess

_SENT = re.compile(r"\bbytes_sent:(\d+)")


def tcp_bytes_sent(pid: int) -> int | None:
    """The sum over ``pid``'s open TCP sockets, or None where ``ss`` cannot say."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total, mine = 0, False
    for line in out.splitlines():
        if line[:1].isspace():                    # a socket's tcp_info, under the socket's own line
            m = _SENT.search(line)
            if mine and m:
                total += int(m.group(1))
        else:
            mine = f"pid={pid}," in line
    return total
