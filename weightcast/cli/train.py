"""`weightcast train ...`: local training runs and durable ones on the fleet."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from peerd import manifest as mf
from peerd.units import parse_size
from weightcast.cli.common import Progress, connect, print_started, run_steering


def cmd_train_run(a) -> int:
    from training.config import TrainConfig
    from training.launch import launch
    cfg = TrainConfig.load(a.config, a.set)           # ConfigError (exit 2) before any process starts
    print(f"training: {cfg.family} {cfg.layout} x{cfg.world_size}, comm {cfg.comm}, {cfg.steps} steps",
          file=sys.stderr)
    tokens = cfg.global_batch * (cfg.seq_len - 1)
    recent: list[float] = []

    def show(u: dict) -> None:                      # every log_every steps, and the last
        recent[:] = [*recent[-9:], u["step_s"]]
        if u["step"] % cfg.log_every and u["step"] != cfg.steps:
            return
        step_s = statistics.median(recent)
        print(f"step {u['step']}/{cfg.steps}  loss {u['loss']:.4f}  {tokens / step_s:,.0f} tokens/s  "
              f"ETA {(cfg.steps - u['step']) * step_s:.0f} s", file=sys.stderr, flush=True)
    res = launch(cfg, progress=show)
    print(f"MFU {res['mfu']:.2f} of a measured {res['peak_flops'] / 1e9:,.0f} GFLOP/s matmul peak; a step "
          f"{res['step_split']['comm_fraction']:.0%} communication", file=sys.stderr)
    if res["log_messages"]:
        print(f"{res['log_messages']} distinct lines from the ranks (warnings, notices) in {res['log']}",
              file=sys.stderr)
    print(json.dumps(res if a.full else {k: v for k, v in res.items() if k not in ("losses", "step_s", "config")},
                     indent=None if a.json else 1))
    return 0


def _train_hosts(spec: str) -> list[str]:
    """``--hosts``: ids comma-separated, or a file of them (lines, a JSON list, or a fleet inventory)."""
    path = Path(spec)
    if not path.is_file():
        if "/" in spec:                     # host ids never hold a slash: a hosts file that is not there
            raise SystemExit(f"error: hosts file {spec} not found (or give the ids: --hosts h0,h1)")
        return [h for h in spec.split(",") if h]
    text = path.read_text()
    try:
        doc = json.loads(text)
    except ValueError:
        return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not isinstance(doc, list) or not all(isinstance(h, str) or (isinstance(h, dict) and isinstance(h.get("id"), str))
                                            for h in doc):
        raise SystemExit(f"error: {path}: a hosts file is one id per line, a JSON list of ids, or a fleet "
                         'inventory [{"id": ...}, ...]')
    return [h if isinstance(h, str) else h["id"] for h in doc]


def cmd_train(a) -> int:
    """start | status | pause | resume | abort | checkpoint: durable training runs (TrainingWorkflow)."""
    from weightcast.training_runs import (UnknownRun, check_training, find_run, start_training, training_id,
                                          training_status)
    from workflows.training import TrainingWorkflow

    if a.sub == "start":             # everything checked before connecting anywhere
        from training.config import TrainConfig
        from workflows.training_types import TrainingInput
        cfg = TrainConfig.load(a.config, a.set)
        inp = TrainingInput(run=a.run, config=cfg.to_dict(), hosts=_train_hosts(a.hosts),
                            checkpoint_dir=str(a.checkpoint_dir.resolve()), checkpoint_every=a.checkpoint_every,
                            checkpoint_every_s=a.checkpoint_every_s,
                            export_dir=str(a.export.resolve()) if a.export else "",
                            rollout=training_rollout(a), publish_chunk_size=a.chunk_size,
                            min_world_size=a.min_world_size, checkpoint_archive=archive_spec(a))
        check_training(inp)

    async def go():
        client = await connect(a.temporal, a.namespace)
        if a.sub == "start":
            h = await start_training(client, inp)
            print_started(h)
            if not a.wait:
                return 0
            run = a.run
        else:
            run = await find_run(client, a.run)        # the run name or the workflow id `start` printed
        if a.sub in ("start", "status") and (getattr(a, "wait", False) or getattr(a, "watch", False)):
            return await _watch_training(client, run)
        h = client.get_workflow_handle(training_id(run))
        if a.sub == "status":
            print(json.dumps(await training_status(client, run)))
            return 0
        update = {"pause": TrainingWorkflow.pause, "resume": TrainingWorkflow.resume,
                  "abort": TrainingWorkflow.abort, "checkpoint": TrainingWorkflow.checkpoint_now}[a.sub]
        print(await h.execute_update(update, a.reason))
        return 0

    try:
        return run_steering(go)
    except UnknownRun as e:
        print(f"error: {e} on {a.temporal} (namespace {a.namespace})", file=sys.stderr)
        return 2


def archive_spec(a) -> dict | None:
    """`train start --checkpoint-archive s3://bucket/prefix`: where complete checkpoints are copied."""
    if not a.checkpoint_archive:
        return None
    from peerd.origin import OriginError, OriginSpec
    endpoint = a.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        raise SystemExit("error: --checkpoint-archive needs --endpoint (or $AWS_ENDPOINT_URL)")
    try:
        spec = OriginSpec.parse_url(a.checkpoint_archive, endpoint)
    except OriginError as e:
        raise SystemExit(f"error: --checkpoint-archive: {e}") from None
    return {"endpoint": spec.endpoint, "bucket": spec.bucket, "prefix": spec.prefix}


def training_rollout(a):
    """`train start --roll-out FLEET`: the rollout the run starts once its weights are exported."""
    if a.roll_out is None:
        return None
    from weightcast.publish import hosts_from_file
    from workflows.types import RolloutInput
    endpoint = a.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    missing = [n for n, v in (("--model", a.model), ("--bucket", a.bucket), ("--endpoint", endpoint)) if not v]
    if missing:
        raise SystemExit(f"error: --roll-out needs {', '.join(missing)}")
    version = a.version or a.run
    return RolloutInput(a.model, version, "", {"endpoint": endpoint, "bucket": a.bucket,
                                               "prefix": a.prefix or f"{a.model}/{version}"},
                        hosts_from_file(a.roll_out), router=a.router, previous_version=a.previous_version,
                        max_concurrent_loads=a.max_concurrent_loads, failure_budget=a.failure_budget)


async def _watch_training(client, run: str) -> int:
    """Step, loss, tokens/s, ETA, last checkpoint and recoveries until the run ends (0 done, 1 not)."""
    from temporalio.client import WorkflowExecutionStatus
    from weightcast.training_runs import training_status
    bar, t0, seen = Progress(f"train-{run}"), time.monotonic(), 0
    while True:
        st = await training_status(client, run)
        for r in st.get("recoveries", [])[seen:]:
            print(f"\nrecovery: rank {r['rank']} on {r['host']}: {r['reason']}; {r['action']}", file=sys.stderr)
        seen = len(st.get("recoveries", []))
        bar.label = (f"train-{run} {st.get('phase')} loss {st.get('loss')} {st.get('tokens_per_s')} tok/s "
                     f"eta {st.get('eta_s')} s ckpt {st.get('last_checkpoint')}")
        if st.get("phase") == "rolling out":
            bar.label = f"train-{run} rolling out: {st.get('rollout_id')} (weightcast rollout status --watch)"
        bar(time.monotonic() - t0, st.get("step") or 0, max(1, st.get("total_steps") or 1))
        if st["status"] != WorkflowExecutionStatus.RUNNING.name:
            bar.close()
            print(json.dumps({k: st.get(k) for k in ("status", "phase", "final_loss", "recoveries", "export_dir",
                                                      "version_id", "rollout_id", "detail")}))
            return 0 if st["status"] == WorkflowExecutionStatus.COMPLETED.name else 1
        await asyncio.sleep(1)


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
    tr = sub.add_parser("train", help="distributed training: the reference transformer or a Llama-family model").add_subparsers(
        dest="sub", required=True)
    trr = tr.add_parser("run", help="run one training job locally across its rank processes")
    trr.add_argument("config", nargs="?", type=Path, help="JSON or TOML TrainConfig (default: the defaults)")
    trr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a setting, e.g. --set steps=100 --set model.d_model=128")
    trr.add_argument("--full", action="store_true", help="include the per-step losses and the config")
    trr.add_argument("--json", action="store_true")
    trr.set_defaults(fn=cmd_train_run)
    for name, hlp in [("start", "start (or attach to) a durable run on the fleet's host workers (Temporal)"),
                      ("status", "phase, step, loss, tokens/s, ETA, last checkpoint, recoveries"),
                      ("pause", "stop every rank at the next step boundary, that step checkpointed"),
                      ("resume", "continue a paused run from its checkpoint"), ("abort", "stop the run"),
                      ("checkpoint", "take a checkpoint now")]:
        p = tr.add_parser(name, help=hlp)
        p.add_argument("--temporal", default="127.0.0.1:7233")
        p.add_argument("--namespace", default="default")
        p.set_defaults(fn=cmd_train)
        if name == "start":
            p.add_argument("config", nargs="?", type=Path, help="JSON or TOML TrainConfig (default: the defaults)")
            p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
            p.add_argument("--run", required=True, help="the run's name: its workflow is train-<run>")
            p.add_argument("--hosts", required=True,
                           help="host ids, comma-separated, or a file of them (one per line, a JSON list of ids, "
                                "or a fleet inventory [{\"id\": ...}]): the first world_size run ranks, the rest "
                                "are spares")
            p.add_argument("--checkpoint-dir", type=Path, required=True, help="a directory every host reaches (a shared volume), or with {host} in it each host's own disk "
                                "('/nvme/ckpt/{host}'): every checkpoint is then replicated to the ranks' hosts "
                                "through peerd's swarm (the host workers need --peerd, --store and the cluster token)")
            p.add_argument("--checkpoint-every", type=int, default=10, help="steps between async checkpoints")
            p.add_argument("--checkpoint-every-s", type=float, default=0.0,
                           help="also checkpoint once this many seconds have passed since the last save "
                                "(rank 0's clock; 0, the default: by steps only)")
            p.add_argument("--export", type=Path, help="write the finished weights here (safetensors + smoke)")
            p.add_argument("--checkpoint-archive", metavar="s3://BUCKET/PREFIX",
                           help="also copy every complete checkpoint here (endpoint: --endpoint or "
                                "$AWS_ENDPOINT_URL); an attempt restores a newer one from it first")
            p.add_argument("--min-world-size", type=int, default=0,
                           help="a lost host with no spare left: go on with fewer data-parallel ranks, down to "
                                "this many (0, the default: wait for the host to return)")
            ro_ = p.add_argument_group("roll the trained weights out (needs --export and a publish worker)")
            ro_.add_argument("--roll-out", type=Path, metavar="FLEET",
                             help='fleet inventory JSON [{"id", "model_server", "rack"}, ...]: after export, publish '
                                  "the weights and roll them out to these hosts (a child RolloutWorkflow)")
            ro_.add_argument("--model", help="the model name to publish under")
            ro_.add_argument("--version", help="the version to publish (default: the run's name)")
            ro_.add_argument("--endpoint", help="S3 endpoint URL (default $AWS_ENDPOINT_URL)")
            ro_.add_argument("--bucket")
            ro_.add_argument("--prefix", help="default <model>/<version>")
            ro_.add_argument("--router", default="", help="router address (empty: no traffic phase)")
            ro_.add_argument("--previous-version", default="", help="where an aborted rollout sends traffic back")
            ro_.add_argument("--max-concurrent-loads", type=int, default=2)
            ro_.add_argument("--failure-budget", type=float, default=0.05)
            ro_.add_argument("--chunk-size", type=parse_size, default=mf.DEFAULT_CHUNK_SIZE)
            p.add_argument("--wait", action="store_true", help="watch until the run ends (exit 0 done, 1 not)")
        else:
            p.add_argument("run")
        if name == "status":
            p.add_argument("--watch", action="store_true")
        if name in ("pause", "resume", "abort", "checkpoint"):
            p.add_argument("--reason", default="", required=name == "abort", help="recorded in the history")
