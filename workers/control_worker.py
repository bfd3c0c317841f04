"""The control worker: rollout and training workflows and control-plane activities on ``weightcast-control``."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Replayer, Worker

from activities.control import ControlActivities
from lib.secret_input import ADMIN_TOKEN, add_secret_file_arg, read_secret
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


def build(client: Client, trusted_keys: list[Path], s3_credentials: tuple[str, str] | None = None,
          admin_token: str = "", activities: ControlActivities | None = None) -> Worker:
    """``s3_credentials`` (access key, secret) to read published manifests, default the AWS_* variables;
    ``admin_token`` for the router's admin API. ``activities``: built (and warmed) by the caller."""
    acts = activities or ControlActivities(trusted_keys, s3_credentials, admin_token)
    return Worker(client, task_queue=CONTROL_QUEUE, workflows=WORKFLOWS,
                  activities=[acts.check_manifest, acts.check_manifest_ref, acts.check_inventory, acts.set_traffic,
                              acts.preflight, acts.analyze_traffic])


async def run(address: str, namespace: str, trusted_keys: list[Path], admin_token: str) -> None:
    client = await Client.connect(address, namespace=namespace)
    acts = ControlActivities(trusted_keys, admin_token=admin_token)
    await acts.warm()
    await build(client, trusted_keys, activities=acts).run()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast-control-worker")
    ap.add_argument("--temporal", default="127.0.0.1:7233")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--trusted-key", type=Path, action="append", required=True)
    add_secret_file_arg(ap, ADMIN_TOKEN, "router's admin token")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    asyncio.run(run(a.temporal, a.namespace, a.trusted_key, read_secret(a, ADMIN_TOKEN)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
