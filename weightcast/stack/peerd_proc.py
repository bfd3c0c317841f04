"""Start real peerd processes on loopback (the benchmark, the tests and `weightcast dev up` use this)."""
from __future__ import annotations

from pathlib import Path

from weightcast.stack.module_proc import ModuleProc


class PeerdProc(ModuleProc):
    """``host``: the address it listens on; ``netns``: the network namespace it runs in (a host of a
    lib/netns.py topology)."""

    def __init__(self, id: str, port: int, store: Path, args: list[str] = (), env: dict | None = None,
                 host: str = "127.0.0.1", netns: str | None = None, token: str = ""):
        listen = ["--listen", host] if host != "127.0.0.1" else []
        # the cluster token by environment, never on the command line (`ps` shows that to every user)
        super().__init__(f"peerd {id}", "peerd", store.parent,
                         ["--id", id, "--store", str(store), "--port", str(port), *listen, *args],
                         {**(env or {}), "WEIGHTCAST_TOKEN": token}, netns=netns)
        self.id, self.port, self.store, self.host = id, port, store, host
        self.store.mkdir(parents=True, exist_ok=True)

    @property
    def addr(self) -> str:
        return f"http://{self.host}:{self.port}"


def fleet_args(me: str, ports: dict[str, int], *, trusted_key: Path, rate: float | None,
               origin_rate: float | None, rack: str = "", extra: list[str] = (), hosts: dict[str, str] | None = None,
               racks: dict[str, str] | None = None) -> list[str]:
    """Every peer as a seed; ``hosts`` (id -> address, default loopback) and ``racks`` (id -> rack,
    default ``rack`` for all) place them on a real network."""
    hosts, racks = hosts or {}, racks or {}
    args = ["--trusted-key", str(trusted_key), "--rack", racks.get(me, rack),
            "--upload-rate", str(rate or 0), "--download-rate", str(rate or 0), "--origin-rate", str(origin_rate or 0)]
    for other, port in ports.items():
        if other != me:
            args += ["--peer", f"{other}=http://{hosts.get(other, '127.0.0.1')}:{port}@{racks.get(other, rack)}"]
    return args + list(extra)
