"""The model server and the router as the processes a fleet runs (their real entry points): they
refuse to start without an admin token, enforce it, and close connections that never finish a
request head."""
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from lib.ports import free_ports
from lib.processes import child_options, stop_process


def start(module: str, port: int, *args: str, token: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTCAST_ADMIN_TOKEN"}
    if token is not None:
        env["WEIGHTCAST_ADMIN_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--header-timeout", "1", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **child_options())


def wait_up(port: int, path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1)
            return
        except urllib.error.HTTPError:
            return                       # it answered: up
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def status_of(req: urllib.request.Request) -> int:
    try:
        return urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("module,extra,admin_path", [
    ("serving.router", [], "/admin/models/tiny"),
    ("serving.server", ["--id", "h1", "--store", "/nonexistent-store"], "/v1/unload"),
])
def test_serving_processes_need_a_token_and_shed_silent_connections(module, extra, admin_path, keys):
    port, port2 = free_ports(2)
    refused = start(module, port2, *extra, token=None)
    out, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2 and b"admin token" in out
    if module == "serving.server":              # and the keys whose signed versions it may load
        refused = start(module, port2, *extra, token="s3cret")
        out, _ = refused.communicate(timeout=60)
        assert refused.returncode == 2 and b"--trusted-key" in out
        extra = [*extra, "--trusted-key", str(keys["pub_path"])]

    proc = start(module, port, *extra, token="s3cret")
    try:
        wait_up(port, "/metrics")
        body = json.dumps({"model": "tiny", "model_version": "v1"}).encode()
        method = "GET" if module == "serving.router" else "POST"
        plain = urllib.request.Request(f"http://127.0.0.1:{port}{admin_path}", data=body if method == "POST" else None,
                                       method=method)
        assert status_of(plain) == 401
        authed = urllib.request.Request(plain.full_url, data=plain.data, method=method,
                                        headers={"Authorization": "Bearer s3cret"})
        assert status_of(authed) == 404          # authenticated; nothing of that name here

        async def silent() -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")            # never finished
            await w.drain()
            data = await asyncio.wait_for(r.read(), timeout=10)
            w.close()
            return data
        assert asyncio.run(silent()) == b""
    finally:
        stop_process(proc)
