"""`weightcast dev up|down`: keep the embedded stack running in the background for hands-on use.

`up` starts ``python -m weightcast.stack.dev serve`` in its own session and returns once the stack is
ready; the stack writes ``<dir>/state.json`` (addresses, credentials, the host inventory, the dev
signing key) that `weightcast publish --dev <dir>` and the rollout commands read. `down` sends SIGTERM
and waits for a clean stop. Everything listens on 127.0.0.1 only."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lib.atomic import write_atomic
from peerd.signing import generate_keypair
from weightcast.stack.embedded import EmbeddedStack
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY

DEFAULT_DIR = Path(".weightcast-dev")


class DevError(RuntimeError):
    pass


def state_path(d: Path) -> Path:
    return d / "state.json"


def read_state(d: Path) -> dict:
    try:
        return json.loads(state_path(d).read_text())
    except FileNotFoundError:
        raise DevError(f"no dev stack in {d}: run `weightcast dev up --dir {d}` first") from None


def _alive(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:    # our own child (up and down in one process): reap it
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def up(d: Path, hosts: int, rate: float, temporal_port: int, ui_port: int, timeout: float = 180) -> dict:
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    if state_path(d).exists():
        st = read_state(d)
        if _alive(st["pid"]):
            return {**st, "note": "already up"}
        state_path(d).unlink()            # a stack that died without `down`: start afresh
    cmd = [sys.executable, "-m", "weightcast.stack.dev", "serve", "--dir", str(d), "--hosts", str(hosts),
           "--rate", str(rate), "--temporal-port", str(temporal_port), "--ui-port", str(ui_port)]
    with open(d / "dev.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while not state_path(d).exists():
        if proc.poll() is not None:
            raise DevError(f"the dev stack exited with {proc.returncode}; see {d / 'dev.log'}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise DevError(f"the dev stack was not up within {timeout:.0f}s; see {d / 'dev.log'}")
        time.sleep(0.2)
    return read_state(d)


def down(d: Path, timeout: float = 60) -> dict:
    d = d.resolve()
    st = read_state(d)
    pid = st["pid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    state_path(d).unlink(missing_ok=True)
    return {"stopped": pid, "dir": str(d)}


async def serve(d: Path, hosts: int, rate: float, temporal_port: int, ui_port: int) -> None:
    key, pub = d / "dev-signing.pem", d / "dev-signing.pub"
    if not key.exists():
        generate_keypair(key, pub)
    stack = await EmbeddedStack(d / "stack", pub, [f"h{i}" for i in range(hosts)], rate=rate or None, ui=True,
                                temporal_port=temporal_port, ui_port=ui_port, supervise=True,
                                preload_training=True).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        state = {"pid": os.getpid(), "dir": str(d), "temporal": stack.temporal_addr,
                 "ui": f"http://127.0.0.1:{stack.ui_port}",
                 "s3": {"endpoint": stack.s3.endpoint, "bucket": stack.s3.bucket,
                        "access_key": ACCESS_KEY, "secret_key": SECRET_KEY},
                 "router": stack.router_addr, "token": stack.token, "signing_key": str(key), "trusted_key": str(pub),
                 "hosts": [asdict(h) for h in stack.hosts],
                 "peerd": {i: p.addr for i, p in stack.peerd.items()}}
        # appears whole (`up` waits for it), readable only by its owner: it holds the cluster token and S3 keys
        write_atomic(state_path(d), json.dumps(state, indent=1), mode=0o600)
        await stop.wait()
    finally:
        state_path(d).unlink(missing_ok=True)
        await stack.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m weightcast.stack.dev")
    ap.add_argument("cmd", choices=["serve"])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0)
    ap.add_argument("--temporal-port", type=int, default=7233)
    ap.add_argument("--ui-port", type=int, default=8233)
    a = ap.parse_args(argv)
    asyncio.run(serve(a.dir, a.hosts, a.rate, a.temporal_port, a.ui_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
