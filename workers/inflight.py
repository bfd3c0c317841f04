"""The rollout activities a host worker is running, kept in a small file, so that a worker restarted
after a crash hands its host's work back at once.

A worker that dies mid-activity leaves the attempt "started" on the server, which retries it only
when its heartbeat timeout expires (30 s by default). The restarted worker reads the file before it
polls and fails each listed attempt by its task token ("host worker restarted"): Temporal retries it
now, on the same queue, and this worker picks it up. A token names one attempt, so an attempt that
already ended (timed out meanwhile) is refused by the server and left alone.
"""
from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from lib.atomic import write_atomic

log = logging.getLogger("weightcast.host_worker")
TRACKED = frozenset({"distribute", "load_version", "discard_version"})   # training ranks recover on their own


class InFlight(Interceptor):
    def __init__(self, path: Path):
        self.path = path
        self.running: dict[str, dict] = {}

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Recorder(next, self)

    def _save(self) -> None:
        write_atomic(self.path, json.dumps(list(self.running.values())).encode())

    def started(self, info: activity.Info) -> str:
        key = base64.b64encode(info.task_token).decode()
        self.running[key] = {"task_token": key, "activity": info.activity_type,
                             "workflow_id": info.workflow_id, "attempt": info.attempt}
        self._save()
        return key

    def ended(self, key: str) -> None:
        self.running.pop(key, None)
        self._save()

    async def release_orphans(self, client: Client) -> list[dict]:
        """Fail every attempt a dead predecessor left running (call before polling). Returns them."""
        try:
            orphans = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except ValueError as e:             # cut short by the crash: nothing to release from it
            log.warning("unreadable in-flight file", extra={"path": str(self.path), "error": str(e)})
            orphans = []
        released = []
        for o in orphans:
            handle = client.get_async_activity_handle(task_token=base64.b64decode(o["task_token"]))
            try:
                await handle.fail(ApplicationError("the host worker running it restarted", type="WorkerRestarted"))
                released.append(o)
            except RPCError as e:             # that attempt already ended: nothing to hand back
                log.info("in-flight attempt already ended", extra={**o, "task_token": None, "error": e.message})
        if released:
            log.info("handed back the attempts of a dead worker",
                     extra={"activities": [(o["activity"], o["workflow_id"]) for o in released]})
        self.running.clear()
        self._save()
        return released


class _Recorder(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, ledger: InFlight):
        super().__init__(next)
        self.ledger = ledger

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if info.activity_type not in TRACKED:
            return await self.next.execute_activity(input)
        key = self.ledger.started(info)
        try:
            return await self.next.execute_activity(input)
        finally:
            self.ledger.ended(key)
