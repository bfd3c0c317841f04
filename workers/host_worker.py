"""The host worker: activities only, on ``host-<id>``, driving this host's peerd, model server and training ranks."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.host import HostActivities
from activities.training import TrainingActivities
from lib.secret_input import ADMIN_TOKEN, CLUSTER_TOKEN, add_secret_file_arg, read_secret
from workers.inflight import InFlight
from workers.stop_signal import stop_requested
from workflows.types import host_queue


# Heartbeats (live progress, and the channel that delivers a cancellation) reach the server at most
# this often; the SDK's default is 0.8 x the heartbeat timeout (24 s at 30 s), too slow for a pause or
# an abort that must act within seconds and for status within 3 s. One small RPC per running
# distribution per interval: on fleets of thousands of hosts, --heartbeat-every 2 or 3 halves the load.
HEARTBEAT_EVERY_S = 1.0


def build(client: Client, host_id: str, peerd_addr: str, token: str, store: Path, model_server: str,
          admin_token: str = "", heartbeat_every_s: float = HEARTBEAT_EVERY_S, train_dir: Path | None = None,
          advertise_host: str = "127.0.0.1", inflight: InFlight | None = None, registry=None,
          preload_training: bool = False) -> Worker:
    acts = HostActivities(host_id, peerd_addr, token, store, model_server, admin_token)
    train = TrainingActivities(host_id, train_dir or store.parent / "train", advertise_host,
                               peerd=peerd_addr, token=token, store=store, registry=registry)
    if preload_training:                    # from the running loop of main()
        train.forks.warm_soon()
    every = timedelta(seconds=heartbeat_every_s)
    return Worker(client, task_queue=host_queue(host_id),
                  activities=[acts.distribute, acts.load_version, acts.discard_version,
                              train.rendezvous, train.train_rank, train.set_run_control, train.export_weights],
                  max_concurrent_activities=8, max_heartbeat_throttle_interval=every,
                  default_heartbeat_throttle_interval=every, interceptors=[inflight] if inflight else [])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast-host-worker")
    ap.add_argument("--id", required=True)
    ap.add_argument("--temporal", default="127.0.0.1:7233")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--peerd", default="http://127.0.0.1:7700")
    add_secret_file_arg(ap, CLUSTER_TOKEN, "peerd's cluster token")
    add_secret_file_arg(ap, ADMIN_TOKEN, "model server's and router's admin token (load, unload, permits)")
    ap.add_argument("--store", type=Path, required=True, help="the same --store as this host's peerd")
    ap.add_argument("--model-server", default="http://127.0.0.1:8100")
    ap.add_argument("--heartbeat-every", type=float, default=HEARTBEAT_EVERY_S,
                    help=f"seconds between heartbeats reaching Temporal: status lag and pause/abort latency "
                         f"(default {HEARTBEAT_EVERY_S})")
    ap.add_argument("--train-dir", type=Path, help="where training ranks keep their logs and progress "
                                                   "(default: next to --store, train/)")
    ap.add_argument("--advertise-host", default="127.0.0.1",
                    help="this host's address for other ranks (rank 0's rendezvous store)")
    ap.add_argument("--inflight-file", type=Path,
                    help="where the rollout activities running now are listed, so that after a crash the restarted "
                         "worker hands them back at once (default: next to --store, host-worker.inflight.json)")
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="serve Prometheus metrics of this host's training ranks (tokens/s, MFU, loss) on this port")
    ap.add_argument("--preload-training", action=argparse.BooleanOptionalAction, default=True,
                    help="start the training ranks' fork server (which imports torch) in the background at "
                         "start, so that a first rank starts without waiting for it; a host that only serves "
                         "rollouts can skip it and save torch's memory and CPU-seconds (default: preload)")
    ap.add_argument("--ready-file", type=Path, help="write {id, task_queue} JSON here once polling")
    return ap


def main(argv=None) -> int:
    from lib.logging_setup import setup
    a = build_parser().parse_args(argv)
    setup()

    async def run():
        client = await Client.connect(a.temporal, namespace=a.namespace)
        inflight = InFlight(a.inflight_file or a.store.parent / "host-worker.inflight.json")
        registry = None
        if a.metrics_port:
            from prometheus_client import CollectorRegistry, start_http_server
            registry = CollectorRegistry()
            start_http_server(a.metrics_port, addr="127.0.0.1" if a.advertise_host == "127.0.0.1" else "0.0.0.0",
                              registry=registry)
        await inflight.release_orphans(client)        # before polling: what a crashed predecessor was running
        async with build(client, a.id, a.peerd, read_secret(a, CLUSTER_TOKEN), a.store, a.model_server,
                         read_secret(a, ADMIN_TOKEN), a.heartbeat_every,
                         a.train_dir, a.advertise_host, inflight, registry, a.preload_training):
            if a.ready_file:
                a.ready_file.write_text(json.dumps({"id": a.id, "task_queue": host_queue(a.id), "pid": os.getpid()}))
            await stop_requested()
    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
