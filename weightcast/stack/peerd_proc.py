"""Start real peerd processes on loopback (the benchmark, the tests and `weightcast dev up` use this)."""
from __future__ import annotations

from pathlib import Path

from weightcast.stack.module_proc import ModuleProc


class PeerdProc(ModuleProc):
    def __init__(self, id: str, port: int, store: Path, args: list[str] = (), env: dict | None = None):
        super().__init__(f"peerd {id}", "peerd", store.parent,
                         ["--id", id, "--store", str(store), "--port", str(port), *args], dict(env or {}))
        self.id, self.port, self.store = id, port, store
        self.store.mkdir(parents=True, exist_ok=True)

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def fleet_args(me: str, ports: dict[str, int], *, token: str, trusted_key: Path, rate: float | None,
               origin_rate: float | None, rack: str = "", extra: list[str] = ()) -> list[str]:
    args = ["--token", token, "--trusted-key", str(trusted_key), "--rack", rack,
            "--upload-rate", str(rate or 0), "--download-rate", str(rate or 0), "--origin-rate", str(origin_rate or 0)]
    for other, port in ports.items():
        if other != me:
            args += ["--peer", f"{other}=http://127.0.0.1:{port}@{rack}"]
    return args + list(extra)
