"""The publish worker: the manifest signing key's only holder, on ``weightcast-publish``.

A durable training run with a rollout (``weightcast train start --roll-out``) asks it to sign a probe
before any rank starts (the control worker must trust the key) and, after export, to upload and sign
the finished weights. Run it where the key may live (CI's protected environment, a secrets-backed pod),
with read access to the volume the exports are written to and write access to the bucket.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.publish import PublishActivities
from workers.stop_signal import stop_requested
from workflows.types import PUBLISH_QUEUE


def build(client: Client, key: Path, s3_credentials: tuple[str, str] | None = None) -> Worker:
    """``s3_credentials`` (access key, secret) with write access; default the AWS_* variables."""
    acts = PublishActivities(key, s3_credentials)
    return Worker(client, task_queue=PUBLISH_QUEUE, activities=[acts.sign_probe, acts.publish_export])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast-publish-worker")
    ap.add_argument("--temporal", default="127.0.0.1:7233")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--key", type=Path, required=True, help="Ed25519 private key (PEM) the fleet trusts")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)

    async def run():
        client = await Client.connect(a.temporal, namespace=a.namespace)
        async with build(client, a.key):
            await stop_requested()
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
