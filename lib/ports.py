"""Free TCP ports for the processes a stack, a benchmark or a test starts on this machine.

A port is picked here and bound later by another process. Picked from the kernel's ephemeral range
(what binding port 0 does), it could be taken in between as the source port of any outgoing
connection; so ports are picked at random from below that range (from 10000 up), where the kernel
never hands them out. ``$WEIGHTCAST_PORTS`` ("LOW-HIGH") narrows the choice: processes that start
stacks side by side (parallel test workers) give each its own range and never pick each other's.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST = 10000                  # below: well-known and registered services' ports
ENV = "WEIGHTCAST_PORTS"
_random = random.SystemRandom()     # not the shared generator: a seeded one would repeat its picks


def port_range() -> range:
    """The ports ``free_ports`` picks from."""
    spec = os.environ.get(ENV)
    if spec:
        try:
            low, high = (int(x) for x in spec.split("-"))
        except ValueError:
            raise ValueError(f"${ENV} must be LOW-HIGH (two port numbers), not {spec!r}") from None
        if not 1024 <= low < high <= 65535:
            raise ValueError(f"${ENV}={spec!r} is not a range of unprivileged ports")
        return range(low, high + 1)
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768                       # Linux's default
    return range(LOWEST, max(ephemeral_low, LOWEST + 1000))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports nothing listens on at ``host`` (an address of this machine) right now."""
    candidates = port_range()
    tries = _random.sample(candidates, min(len(candidates), max(4 * n, 64)))
    socks, ports = [], []
    try:
        for port in tries:
            if len(ports) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:                         # in use (or lingering after a close): the next one
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise OSError(f"no {n} free ports among {len(tries)} tried in {candidates.start}-{candidates.stop - 1}")
    return ports
