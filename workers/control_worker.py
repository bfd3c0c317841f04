"""The control worker: rollout and training workflows and control-plane activities on ``weightcast-control``."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from activities.control import ControlActivities
from lib.atomic import write_atomic
from lib.secret_input import ADMIN_TOKEN, add_secret_file_arg, read_secret
from workers.stop_signal import stop_requested
from workflows.host_batch import HostBatchWorkflow
from workflows.preflight import PreflightWorkflow
from workflows.rollback import RollbackWorkflow
from workflows.rollout import RolloutWorkflow
from workflows.training import TrainingWorkflow
from workflows.types import CONTROL_QUEUE

WORKFLOWS = [RolloutWorkflow, HostBatchWorkflow, PreflightWorkflow, RollbackWorkflow, TrainingWorkflow]


def replayer() -> Replayer:
    """Replays histories against every workflow this worker runs. Without the SDK's 2 s deadlock timer:
    a replay checks determinism, and on a busy machine (an on-call laptop, a loaded CI runner) one
    slow activation is not a deadlock."""
    return Replayer(workflows=WORKFLOWS, debug_mode=True)


# Workflow tasks processed at once. Their activations run on a thread pool but hold one GIL, so more of
# them at once add no throughput; they only stretch each one's wall time, which is what the SDK's fixed
# 2 s deadlock timer measures (TMPRL1101). Measured at 10,000 hosts in docs/control-plane.md.
WORKFLOW_TASK_SLOTS = 4


def build(client: Client, trusted_keys: list[Path], s3_credentials: tuple[str, str] | None = None,
          admin_token: str = "", activities: ControlActivities | None = None,
          workflow_task_slots: int = WORKFLOW_TASK_SLOTS) -> Worker:
    """``s3_credentials`` (access key, secret) to read published manifests, default the AWS_* variables;
    ``admin_token`` for the router's admin API. ``activities``: built (and warmed) by the caller."""
    acts = activities or ControlActivities(trusted_keys, s3_credentials, admin_token)
    return Worker(client, task_queue=CONTROL_QUEUE, workflows=WORKFLOWS,
                  activities=[acts.check_manifest, acts.check_manifest_ref, acts.check_inventory, acts.set_traffic,
                              acts.preflight, acts.analyze_traffic],
                  max_concurrent_workflow_tasks=workflow_task_slots)


async def run(address: str, namespace: str, trusted_keys: list[Path], admin_token: str,
              ready_file: Path | None = None, workflow_task_slots: int = WORKFLOW_TASK_SLOTS) -> None:
    """Poll until SIGTERM or SIGINT; then stop polling and let the workflow tasks in hand finish."""
    client = await Client.connect(address, namespace=namespace)
    acts = ControlActivities(trusted_keys, admin_token=admin_token)
    await acts.warm()
    async with build(client, trusted_keys, activities=acts, workflow_task_slots=workflow_task_slots):
        if ready_file:
            write_atomic(ready_file, json.dumps({"task_queue": CONTROL_QUEUE, "pid": os.getpid()}))
        await stop_requested()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast-control-worker")
    ap.add_argument("--temporal", default="127.0.0.1:7233")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--trusted-key", type=Path, action="append", required=True)
    add_secret_file_arg(ap, ADMIN_TOKEN, "router's admin token")
    ap.add_argument("--workflow-task-slots", type=int, default=WORKFLOW_TASK_SLOTS,
                    help="workflow tasks processed at once (default %(default)s: they share one GIL, and each "
                         "must finish within the SDK's 2 s deadlock timer)")
    ap.add_argument("--ready-file", type=Path, help="write {task_queue, pid} JSON here once polling")
    return ap


def main(argv=None) -> int:
    from lib.logging_setup import setup
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.workflow_task_slots < 1:
        ap.error(f"--workflow-task-slots must be at least 1, got {a.workflow_task_slots}")
    setup()
    asyncio.run(run(a.temporal, a.namespace, a.trusted_key, read_secret(a, ADMIN_TOKEN), a.ready_file,
                    a.workflow_task_slots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
