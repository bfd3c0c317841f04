"""Free ports are picked below the kernel's ephemeral range (no outgoing connection takes one between
its pick and its bind), never one in use, and within $WEIGHTCAST_PORTS when a process is given a range."""
import socket
from pathlib import Path

import pytest

from lib.ports import free_ports, port_range


def test_ports_are_distinct_free_and_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv("WEIGHTCAST_PORTS", raising=False)
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(10000 <= p < ephemeral_low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_given_range_is_kept_and_a_port_in_use_is_skipped(monkeypatch):
    monkeypatch.setenv("WEIGHTCAST_PORTS", "0-0")
    with pytest.raises(ValueError, match="unprivileged"):
        port_range()
    monkeypatch.setenv("WEIGHTCAST_PORTS", "next door")
    with pytest.raises(ValueError, match="LOW-HIGH"):
        free_ports(1)
    held, low = [], 40100        # three ports in a row inside the ephemeral range, all free now
    try:
        while len(held) < 3:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", low + len(held)))
                held.append(s)
            except OSError:
                s.close()
                for h in held:
                    h.close()
                held, low = [], low + len(held) + 1
        monkeypatch.setenv("WEIGHTCAST_PORTS", f"{low}-{low + 2}")
        s = held.pop(1)
        s.close()                                             # the one port nothing holds
        assert free_ports(1) == [low + 1]
        with pytest.raises(OSError, match=f"no 2 free ports among 3 tried in {low}-{low + 2}"):
            free_ports(2)
    finally:
        for s in held:
            s.close()
