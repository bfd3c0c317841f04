"""`weightcast publish` and `weightcast rollout ...`: start, watch and steer rollouts."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from peerd import manifest as mf
from peerd.digests import ALGORITHMS
from peerd.units import parse_size
from workflows.types import HostSpec
from weightcast.cli.common import HASH_HELP, connect, print_started, run_steering, watch_rollout


def cmd_publish(a) -> int:
    """Sign + start the rollout + upload, for CI/CD. Settings come from flags, or from `dev up`'s state."""
    from peerd.origin import OriginSpec
    from weightcast.publish import PublishRequest, hosts_from_file, publish_and_start
    dev = {}
    if a.dev:
        from weightcast.stack.dev import read_state
        dev = read_state(a.dev)
    endpoint = a.endpoint or dev.get("s3", {}).get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")
    bucket = a.bucket or dev.get("s3", {}).get("bucket")
    key = a.key or (Path(dev["signing_key"]) if dev else None)
    missing = [n for n, v in (("--endpoint", endpoint), ("--bucket", bucket), ("--key", key),
                              ("--hosts", a.hosts or dev.get("hosts"))) if not v]
    if missing:
        raise SystemExit(f"error: publish needs {', '.join(missing)} (or --dev DIR of a running `weightcast dev up`)")
    hosts = hosts_from_file(a.hosts) if a.hosts else [HostSpec(**h) for h in dev["hosts"]]
    req = PublishRequest(a.source, a.model, a.version, key,
                         OriginSpec(endpoint, bucket, a.prefix or f"{a.model}/{a.version}"), a.chunk_size,
                         access_key=dev.get("s3", {}).get("access_key"), secret_key=dev.get("s3", {}).get("secret_key"),
                         hash_algorithm=a.hash)
    rollout = {"router": a.router if a.router is not None else dev.get("router", ""),
               "previous_version": a.previous_version, "max_concurrent_loads": a.max_concurrent_loads,
               "pinned_versions": a.pin,
               "failure_budget": a.failure_budget, "unreachable_after_s": a.unreachable_after}

    async def go():
        client = await connect(a.temporal or dev.get("temporal") or "127.0.0.1:7233", a.namespace)
        out = await publish_and_start(client, req, hosts, progress=publish_progress(), **rollout)
        print(json.dumps(out))
        if out.get("previous_outcome", "COMPLETED") != "COMPLETED":
            print(f"error: {out['workflow_id']} already ended {out['previous_outcome']}; a version is rolled out "
                  "once: publish a new version", file=sys.stderr)
            return 3
        if a.wait:
            return await watch_rollout(client, out["workflow_id"])
        return 0
    return asyncio.run(go())


def publish_progress():
    """Publish's steps on stderr: signing, the rollout, the upload every 10 %, done."""
    shown = [-1]

    def say(event: str, facts: dict) -> None:
        if event == "uploading":
            tenth = 10 * facts["bytes_sent"] // max(facts["bytes"], 1)
            if tenth == shown[0]:
                return
            shown[0] = tenth
            print(f"publish: uploaded {facts['bytes_sent']} of {facts['bytes']} bytes", file=sys.stderr)
            return
        print(f"publish: {event} {json.dumps(facts)}", file=sys.stderr)
    return say


def cmd_rollout(a) -> int:
    """start | status | pause | resume | abort | set-concurrency | replay."""
    from weightcast.rollout_status import live_status
    from workflows.rollout import RolloutWorkflow

    if a.sub == "replay":
        from weightcast.history_file import read_history
        from workers.control_worker import replayer
        hist = read_history(a.history)
        res = asyncio.run(replayer().replay_workflow(hist, raise_on_replay_failure=False))
        ok = res.replay_failure is None
        print(json.dumps({"history": str(a.history), "replayed": ok,
                          "failure": None if ok else str(res.replay_failure)}))
        return 0 if ok else 1

    if a.sub == "start":       # check the input before connecting anywhere
        from weightcast.rollouts import InvalidRolloutInput, check_input, start_rollout
        from workflows.types import ManifestRef, RolloutInput
        try:
            spec = json.loads(a.input.read_text())
            spec["hosts"] = [HostSpec(**h) for h in spec["hosts"]]
            if isinstance(spec.get("manifest"), dict):
                spec["manifest"] = ManifestRef(**spec["manifest"])
            inp = RolloutInput(**spec)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise InvalidRolloutInput(f"{a.input}: not a RolloutInput ({type(e).__name__}: {e}); see "
                                      "workflows/types.py for the fields") from None
        check_input(inp)

    async def go():
        client = await connect(a.temporal, a.namespace)
        if a.sub == "start":
            h = await start_rollout(client, inp)
            print_started(h)
            return 0
        if a.sub == "rollback":
            from weightcast.rollouts import rollback
            print(json.dumps(await rollback(client, a.model, a.to, a.reason)))
            return 0
        h = client.get_workflow_handle(a.id)
        if a.sub == "status":
            if a.watch:
                return await watch_rollout(client, a.id)
            print(json.dumps(await live_status(client, a.id)))
            return 0
        if a.sub == "pause":
            await h.signal(RolloutWorkflow.pause)
        elif a.sub == "resume":
            await h.signal(RolloutWorkflow.resume)
        elif a.sub == "abort":
            print(await h.execute_update(RolloutWorkflow.abort, a.reason))
        elif a.sub == "set-concurrency":
            print(await h.execute_update(RolloutWorkflow.set_max_concurrent_loads, a.n))
        return 0

    from temporalio.client import WorkflowFailureError
    from temporalio.service import RPCError, RPCStatusCode
    try:
        return run_steering(go)
    except WorkflowFailureError as e:          # the rollback workflow ran and failed: say why
        print(f"error: {e.cause.cause if e.cause and e.cause.cause else e.cause}", file=sys.stderr)
        return 1
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            print(f"error: rollout {getattr(a, 'id', '')!r} on {a.temporal} (namespace {a.namespace}): {e.message}",
                  file=sys.stderr)
            return 2
        raise


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
    pb = sub.add_parser("publish", help="CI/CD: sign a checkpoint's manifest, start its rollout, upload its bytes meanwhile (idempotent)")
    pb.add_argument("source", type=Path, help="the checkpoint directory")
    pb.add_argument("--model", required=True)
    pb.add_argument("--version", required=True)
    pb.add_argument("--key", type=Path, help="Ed25519 private key (PEM) the fleet trusts")
    pb.add_argument("--endpoint", help="S3 endpoint URL (default $AWS_ENDPOINT_URL); credentials from AWS_* variables")
    pb.add_argument("--bucket")
    pb.add_argument("--prefix", help="default <model>/<version>")
    pb.add_argument("--hosts", type=Path, help='fleet inventory JSON: [{"id", "model_server", "rack"}, ...]')
    pb.add_argument("--router", default=None, help="router address (empty: no traffic phase)")
    pb.add_argument("--previous-version", default="", help="where abort sends traffic back")
    pb.add_argument("--pin", action="append", default=[], metavar="VERSION",
                    help="keep this version in every host's store (besides the new and the previous one)")
    pb.add_argument("--max-concurrent-loads", type=int, default=2)
    pb.add_argument("--failure-budget", type=float, default=0.05)
    pb.add_argument("--unreachable-after", type=float, default=120.0,
                    help="seconds without a worker on a host's queue before it is excluded")
    pb.add_argument("--chunk-size", type=parse_size, default=mf.DEFAULT_CHUNK_SIZE)
    pb.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    pb.add_argument("--temporal", default=None, help="default 127.0.0.1:7233")
    pb.add_argument("--namespace", default="default")
    pb.add_argument("--dev", type=Path, help="take S3, hosts, router, Temporal and key from `weightcast dev up --dir`")
    pb.add_argument("--wait", action="store_true", help="watch the rollout until it ends")
    pb.set_defaults(fn=cmd_publish)

    ro = sub.add_parser("rollout", help="start, watch and steer rollouts (Temporal)").add_subparsers(dest="sub", required=True)
    for name, hlp in [("start", "start (or attach to) the rollout described by a JSON RolloutInput"),
                      ("status", "show a rollout's status"), ("pause", "pause between steps"),
                      ("resume", "resume a paused rollout"), ("abort", "abort; traffic goes back"),
                      ("set-concurrency", "change max_concurrent_loads"),
                      ("rollback", "move a model's traffic back to the version its last rollout replaced"),
                      ("replay", "replay a saved history against this code (on-call)")]:
        p = ro.add_parser(name, help=hlp)
        p.add_argument("--temporal", default="127.0.0.1:7233")
        p.add_argument("--namespace", default="default")
        p.set_defaults(fn=cmd_rollout)
        if name == "start":
            p.add_argument("input", type=Path)
        elif name == "replay":
            p.add_argument("history", type=Path)
        elif name == "rollback":
            p.add_argument("model")
            p.add_argument("--to", default="", help="the version to return to (default: the one replaced last)")
            p.add_argument("--reason", default="", help="recorded in the rollback workflow")
        else:
            p.add_argument("id", help="workflow id, rollout-<model>-<version>")
        if name == "status":
            p.add_argument("--watch", action="store_true", help="live progress until done")
        if name == "abort":
            p.add_argument("--reason", required=True)
        if name == "set-concurrency":
            p.add_argument("n", type=int)
