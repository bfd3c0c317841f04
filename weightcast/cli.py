"""The `weightcast` command line."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from peerd import manifest as mf
from peerd.config import default as peerd_default
from peerd.digests import ALGORITHMS
from peerd.policy import PolicyConfig
from peerd.seeders import MAX_SEEDERS
from peerd.signing import KeyError_, generate_keypair, load_private_key, load_public_key
from peerd.units import parse_rate, parse_size
from workflows.types import HostSpec


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label, self.tty, self.last = label, sys.stderr.isatty(), -1

    def __call__(self, elapsed: float, done: float, total: float) -> None:
        frac = done / total if total else 0
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {elapsed:6.1f}s")
            sys.stderr.flush()
        elif int(frac * 10) != self.last:
            self.last = int(frac * 10)
            print(f"{self.label}: {frac:.0%} after {elapsed:.1f}s", file=sys.stderr)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def cmd_keys_generate(a) -> int:
    generate_keypair(a.out / "manifest-signing.pem", a.out / "manifest-signing.pub")
    print(json.dumps({"private_key": str(a.out / "manifest-signing.pem"),
                      "public_key": str(a.out / "manifest-signing.pub")}))
    return 0


def cmd_manifest_build(a) -> int:
    if a.source.startswith("s3://"):
        from peerd.origin import OriginSpec, S3Origin

        async def build():
            async with S3Origin(OriginSpec.parse_url(a.source, a.endpoint)) as o:
                return await o.build_manifest(a.model, a.version, a.chunk_size, a.hash)
        if not a.endpoint:
            raise SystemExit("building from s3:// needs --endpoint (or set AWS_ENDPOINT_URL)")
        m = asyncio.run(build())
    else:
        m = mf.build_from_directory(Path(a.source), a.model, a.version, a.chunk_size, a.hash)
    data = mf.signed_bytes(m, load_private_key(a.key))
    a.out.write_bytes(data)
    print(json.dumps({**mf.summarize(m), "written": str(a.out)}))
    return 0


def cmd_manifest_verify(a) -> int:
    m = mf.load_signed(a.manifest.read_bytes(), [load_public_key(k) for k in a.trusted_key])
    out = {**mf.summarize(m), "signature": "ok"}
    if a.dir:
        from peerd.store import VersionStore
        vs = VersionStore(a.dir, m)
        vs.model_dir = a.dir
        bad = vs.verify_files()
        out["files_checked"] = len(m.files)
        out["bad_files"] = bad
        if bad:
            print(json.dumps(out))
            return 1
    print(json.dumps(out))
    return 0


def cmd_sim(a) -> int:
    import dataclasses

    from peerd.policy import PolicyConfig
    from peerd.sim.config import SimConfig
    policy = dataclasses.replace(PolicyConfig(), **{k: getattr(a, k) for k in _SIM_POLICY_FLAGS})
    cfg = SimConfig(hosts=a.hosts, size=a.size, chunk=a.chunk, rate=a.rate, racks=a.racks,
                    oversubscription=a.oversubscription, fail_fraction=a.fail, seeders=a.seeders, seed=a.seed,
                    policy=policy, **{k: getattr(a, k) for k in _SIM_PEERD_FLAGS})
    if a.engine == "policies":            # the daemon's own policy objects, one per host (small fleets)
        if a.oversubscription > 1:
            print("error: --engine policies models no rack uplinks (every link is a host's); use --engine fleet "
                  "for oversubscribed racks", file=sys.stderr)
            return 2
        from peerd.sim.policies import simulate_policies
        res = simulate_policies(cfg)
    else:
        from peerd.sim.fleet import simulate
        bar, t0 = Progress("sim"), time.monotonic()     # simulated time against the bound, wall time shown
        res = simulate(cfg, progress=lambda now, lower, done, n: bar(time.monotonic() - t0, min(now, lower), lower))
        bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


_SIM_POLICY_FLAGS = ("max_inflight", "seeder_inflight", "max_per_peer", "window", "plan_size", "rack_grace_s",
                     "rack_rescue_s", "max_cross_rack_peers", "origin_spread")
_SIM_PEERD_FLAGS = ("max_active_peers", "max_uploads", "have_interval", "dead_after", "stall_after")


def _swarm_config(a):
    from bench.swarm import SwarmBenchConfig
    deadline = a.deadline or 60 + 5 * a.size / a.rate     # never wait forever on a hung or dead host
    return SwarmBenchConfig(hosts=a.hosts, size=a.size, rate=a.rate, chunk=a.chunk, kill=a.kill,
                            corrupt_peers=a.corrupt_peers, max_uploads=a.max_uploads,
                            have_interval=a.have_interval, have_stream=a.have_stream, timeout=deadline,
                            warm_pages=a.warm_pages, **{k: getattr(a, k) for k in NETNS_FLAGS if hasattr(a, k)})


NETNS_FLAGS = ("netns", "racks", "oversubscription", "partition_s", "link_down_s", "loss")


def cmd_bench_swarm(a) -> int:
    from bench.swarm import run_swarm_bench
    bar = Progress("swarm")
    res = asyncio.run(run_swarm_bench(_swarm_config(a), progress=bar))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["all_verified"] and res["corrupt_chunks_accepted"] == 0 else 1


def cmd_bench_manifest(a) -> int:
    from bench.manifest_scale import run_manifest_bench
    res = run_manifest_bench([int(x) for x in a.chunks.split(",")], a.files)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


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


def cmd_bench_allreduce(a) -> int:
    from bench.allreduce import method_config, run_allreduce_bench
    method_config(a.ranks, a.steps, a.set)          # bad settings: exit 2 before the namespace is entered
    res = run_allreduce_bench(a.ranks, a.link, a.steps, a.set)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_throughput(a) -> int:
    from bench.throughput import run_throughput_bench
    res = asyncio.run(run_throughput_bench(a.size, a.chunk, a.downloaders, algorithm=a.hash,
                                           warm_pages=a.warm_pages))
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if not res["failed"] else 1


def cmd_bench_gossip(a) -> int:
    from bench.gossip import run_gossip_bench
    print(json.dumps(asyncio.run(run_gossip_bench(a.exchanges, a.rounds, a.peers)), indent=None if a.json else 1))
    return 0


def cmd_bench_receive(a) -> int:
    from bench.receive import run_receive_bench
    print(json.dumps(run_receive_bench(a.size, a.count, a.rounds), indent=None if a.json else 1))
    return 0


def cmd_bench_rebalance(a) -> int:
    from bench.rebalance import rebalance_config, run_rebalance_bench
    rebalance_config(a.ranks, a.steps, a.batch_per_rank, a.set)     # bad settings: exit 2 first
    res = run_rebalance_bench(a.ranks, a.slowdown, a.steps, a.batch_per_rank, a.set, a.link)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_train(a) -> int:
    from bench.train_layouts import run_layout_bench
    res = run_layout_bench(a.layouts.split(","), a.ranks, a.steps, a.set, a.model)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_train_recovery(a) -> int:
    from bench.train_recovery import run_train_recovery_bench
    res = run_train_recovery_bench(a.ranks, a.steps, a.kill_at, a.every, a.set)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["workflow"]["final_loss_matches"] else 1


def cmd_bench_soak(a) -> int:
    from bench.soak import run_soak
    bar, t0 = Progress("soak"), time.monotonic()
    res = asyncio.run(run_soak(_swarm_config(a), a.swarms, progress=lambda k, n: bar(time.monotonic() - t0, k, n)))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["crashed_daemons"] == 0 and res["unverified_swarms"] == 0 else 1


def cmd_bench_load(a) -> int:
    from bench.load import run_load_bench
    res = run_load_bench(a.size, a.repeats, algorithm=a.hash, engine=a.engine)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_engine(a) -> int:
    from bench.engine import run_engine_bench
    print(json.dumps(run_engine_bench(a.engine), indent=None if a.json else 1))
    return 0


def cmd_gpu_check(a) -> int:
    from bench.gpu_check import main as gpu_check
    return gpu_check()


def cmd_bench_router(a) -> int:
    from bench.router import run_router_bench
    print(json.dumps(run_router_bench(a.engine, a.requests), indent=None if a.json else 1))
    return 0


def cmd_bench_rollout_shape(a) -> int:
    from bench.rollout_shape import main_json
    print(main_json(a.hosts, a.racks, a.max_loads, a.max_history_events))
    return 0


def cmd_bench_rollout(a) -> int:
    from bench.rollout import run_rollout_bench
    bar = Progress("rollout")
    res = asyncio.run(run_rollout_bench(a.hosts, a.size, a.rate, a.step_wait, lambda t, d, n, phase: bar(t, d, n)))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["ok"] else 1


def cmd_publish(a) -> int:
    """Upload + sign + start the rollout, for CI/CD. Settings come from flags, or from `dev up`'s state."""
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
        client = await _connect(a.temporal or dev.get("temporal") or "127.0.0.1:7233", a.namespace)
        out = await publish_and_start(client, req, hosts, **rollout)
        print(json.dumps(out))
        if out.get("previous_outcome", "COMPLETED") != "COMPLETED":
            print(f"error: {out['workflow_id']} already ended {out['previous_outcome']}; a version is rolled out "
                  "once: publish a new version", file=sys.stderr)
            return 3
        if a.wait:
            return await _watch(client, out["workflow_id"])
        return 0
    return asyncio.run(go())


def cmd_dev(a) -> int:
    from weightcast.stack import dev
    if a.sub == "up":
        st = dev.up(a.dir, a.hosts, a.rate, a.temporal_port, a.ui_port)
        print(json.dumps({k: st[k] for k in ("temporal", "ui", "router", "dir") if k in st} |
                         {"hosts": [h["id"] for h in st["hosts"]], "note": st.get("note", "up")}))
        print(f"publish a checkpoint: weightcast publish DIR --model M --version V --dev {a.dir}", file=sys.stderr)
    else:
        print(json.dumps(dev.down(a.dir)))
    return 0


async def _enter_pressed() -> None:
    """Wait for a line on stdin from a daemon thread: on Ctrl-C the loop shuts down without waiting
    for a read that may never return (asyncio's default executor would join it)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def read() -> None:
        sys.stdin.readline()
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
    threading.Thread(target=read, daemon=True, name="wait-for-enter").start()
    await done


def cmd_demo(a) -> int:
    from weightcast.demo import run_demo
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()       # every checkpoint load would draw a bar between the demo's lines
    print(f"weightcast demo: Temporal dev server + SeaweedFS + {a.hosts} hosts (peerd, model server, host worker) "
          f"+ router on 127.0.0.1; a ~{a.size >> 20} MiB transformer"
          + (f", and a Llama trained for {a.train_steps} steps" if a.train_steps else "")
          + f"; links limited to {a.rate / 2**20:.0f} MiB/s", file=sys.stderr)
    bar = Progress("rollout")
    # keep the stack up for a person at a terminal (or with --keep); CI and pipes exit on their own
    keep = a.keep or (sys.stdin.isatty() and not os.environ.get("CI"))

    async def hold(res: dict) -> None:
        bar.close()
        print(json.dumps(res, indent=1))
        llama = ("a Llama trained through Temporal (a rank killed mid-run and recovered from a checkpoint), "
                 "exported, published and rolled out by the same workflow" if "training" in res else
                 "a Hugging Face Llama rolled out")
        print(f"OK: {llama} answered the openai client on {res['hf']['engine']} with its golden completion; the "
              "reference checkpoint rolled out through Temporal, verified on every host, loaded, smoke-tested, "
              "answering through the router" if res["ok"] else "FAILED", file=sys.stderr)
        if keep:
            print(f"\nThe stack is still up. Temporal UI: {res['temporal_ui']}\n"
                  f"  weightcast rollout status {res['workflow_id']} --temporal {res['temporal']}\n"
                  "Press Enter (or Ctrl-C) to stop it.", file=sys.stderr)
            await _enter_pressed()

    res = asyncio.run(run_demo(a.hosts, a.size, a.rate, lambda t, d, n, phase: bar(t, d, n), a.keep_ui, hold=hold,
                               train_steps=a.train_steps, engine=a.engine))
    return 0 if res["ok"] else 1


class TemporalUnreachable(RuntimeError):
    pass


WARM_HELP = ("skip writing and freeing the bytes the daemons will store before the clock starts (on a VM, "
             "memory not touched lately costs ~10x more to write the first time; that then lands in the run)")
HASH_HELP = ("chunk digests: sha256 (default) or blake3 (about a quarter of the CPU per byte on every host "
             "that receives, serves or loads it); the version id stays the SHA-256 of the signed manifest")
_TEMPORAL_USED = False    # a Temporal client was made in this process (see entry())


def _operator_identity() -> str:
    import getpass
    import socket
    try:
        user = getpass.getuser()
    except (KeyError, OSError):          # no passwd entry (some containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()} (weightcast cli, pid {os.getpid()})"


async def _connect(address: str, namespace: str):
    from temporalio.client import Client
    global _TEMPORAL_USED
    _TEMPORAL_USED = True
    try:
        # the identity lands in the history with every signal and update: who paused or aborted
        return await Client.connect(address, namespace=namespace, identity=_operator_identity())
    except RuntimeError as e:   # the SDK reports every connect failure as RuntimeError
        raise TemporalUnreachable(f"cannot reach Temporal at {address} (namespace {namespace}): {e}; start it "
                                  "(`weightcast dev up`) or pass --temporal HOST:PORT") from None


WATCH_PAUSED = 4          # `--wait`/`--watch` exit code: the rollout waits for an operator


async def _watch(client, workflow_id: str) -> int:
    """Live view until the rollout ends (0 completed, 1 failed) or pauses (4, with the reason): a
    progress bar of bytes, hosts by state; stuck hosts, a failing step and a control not yet acted on
    are printed as they appear. Rides out Temporal outages (the rollout does): reconnects with
    back-off and says so."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError
    from weightcast.rollout_status import live_status
    h = client.get_workflow_handle(workflow_id)
    t0 = asyncio.get_running_loop().time()
    bar = Progress(workflow_id)
    backoff = 1.0
    said: set[str] = set()

    def say(line: str) -> None:            # each line once, not once a second
        if line not in said:
            said.add(line)
            print(f"\n{line}", file=sys.stderr)
    while True:
        try:
            st = await live_status(client, workflow_id)
            desc = await h.describe()
        except (RPCError, RuntimeError) as e:
            print(f"\nTemporal unreachable ({e}); the rollout goes on without it; retrying in {backoff:.0f} s",
                  file=sys.stderr)
            await asyncio.sleep(backoff)
            backoff = min(30.0, backoff * 2)
            continue
        backoff = 1.0
        bar.label = f"{workflow_id} {st['phase']}{' PAUSED' if st['paused'] else ''} {st['counts']}"
        total = max(1, st["bytes_total"])
        bar(asyncio.get_running_loop().time() - t0, st["bytes_done"] if st["phase"] == "distribute" else
            st["counts"].get("ready", 0) * total / max(1, len(st["hosts"])), total)
        for host, why in sorted(st["stuck"].items()):
            say(f"stuck: {host}: {why}")
        for r in st["retrying"]:
            say(f"retrying: {r['step']} ({r['activity']}), attempt {r['attempt']} failed: {r['error']}")
        if st["stuck_step"]:
            say(f"STUCK: {st['stuck_step']}")
        if st["control"]:
            say(st["control"])
        if desc.status != WorkflowExecutionStatus.RUNNING:
            bar.close()
            print(json.dumps({"status": desc.status.name, "phase": st["phase"], "hosts": st["counts"],
                              "traffic": st["traffic"], "errors": st["errors"], "detail": st["detail"]}))
            return 0 if desc.status == WorkflowExecutionStatus.COMPLETED else 1
        if st["paused"] and not st["control"]:
            bar.close()
            print(json.dumps({"status": "STUCK" if st["stuck_step"] else "PAUSED", "phase": st["phase"],
                              "hosts": st["counts"], "errors": st["errors"], "detail": st["detail"],
                              "stuck": st["stuck_step"] or None}))
            print(f"paused: {st['detail'] or 'by an operator'}; `weightcast rollout resume {workflow_id}` or "
                  f"`weightcast rollout abort {workflow_id} --reason ...`", file=sys.stderr)
            return WATCH_PAUSED
        await asyncio.sleep(1)


def _print_started(handle) -> None:
    """What CI keeps from a start: the workflow's id and run."""
    print(json.dumps({"workflow_id": handle.id, "run_id": handle.result_run_id}))


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
                            rollout=_training_rollout(a), publish_chunk_size=a.chunk_size,
                            min_world_size=a.min_world_size, checkpoint_archive=_archive(a))
        check_training(inp)

    async def go():
        client = await _connect(a.temporal, a.namespace)
        if a.sub == "start":
            h = await start_training(client, inp)
            _print_started(h)
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

    from temporalio.client import WorkflowUpdateFailedError
    try:
        return asyncio.run(go())
    except UnknownRun as e:
        print(f"error: {e} on {a.temporal} (namespace {a.namespace})", file=sys.stderr)
        return 2
    except WorkflowUpdateFailedError as e:
        print(f"error: refused: {e.cause}", file=sys.stderr)
        return 2


def _archive(a) -> dict | None:
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


def _training_rollout(a):
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


def cmd_rollout(a) -> int:
    """start | status | pause | resume | abort | set-concurrency | replay."""
    from weightcast.rollout_status import live_status
    from workflows.rollout import RolloutWorkflow

    if a.sub == "replay":
        from temporalio.worker import Replayer

        from weightcast.history_file import read_history
        from workers.control_worker import WORKFLOWS
        hist = read_history(a.history)
        res = asyncio.run(Replayer(workflows=WORKFLOWS).replay_workflow(hist, raise_on_replay_failure=False))
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
        client = await _connect(a.temporal, a.namespace)
        if a.sub == "start":
            h = await start_rollout(client, inp)
            _print_started(h)
            return 0
        if a.sub == "rollback":
            from weightcast.rollouts import rollback
            print(json.dumps(await rollback(client, a.model, a.to, a.reason)))
            return 0
        h = client.get_workflow_handle(a.id)
        if a.sub == "status":
            if a.watch:
                return await _watch(client, a.id)
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

    from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
    from temporalio.service import RPCError, RPCStatusCode
    try:
        return asyncio.run(go())
    except WorkflowUpdateFailedError as e:
        print(f"error: refused: {e.cause}", file=sys.stderr)
        return 2
    except WorkflowFailureError as e:          # the rollback workflow ran and failed: say why
        print(f"error: {e.cause.cause if e.cause and e.cause.cause else e.cause}", file=sys.stderr)
        return 1
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            print(f"error: rollout {getattr(a, 'id', '')!r} on {a.temporal} (namespace {a.namespace}): {e.message}",
                  file=sys.stderr)
            return 2
        raise


def positive_int(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _swarm_flags(p, *, hosts: int, size: str, rate: str, chunk: str, kill: int, corrupt: int) -> None:
    """The flags of one real-process swarm (bench swarm, and each swarm of bench soak)."""
    p.add_argument("--hosts", type=int, default=hosts)
    p.add_argument("--size", type=parse_size, default=parse_size(size))
    p.add_argument("--rate", type=parse_rate, default=parse_rate(rate))
    p.add_argument("--chunk", type=parse_size, default=parse_size(chunk))
    p.add_argument("--kill", type=int, default=kill, help="hosts SIGKILLed at 40%% of the lower bound (per swarm)")
    p.add_argument("--corrupt-peers", type=int, default=corrupt, help="hosts that serve flipped bytes (per swarm)")
    p.add_argument("--max-uploads", type=int, default=None, help="peerd's --max-uploads (default: peerd's own)")
    p.add_argument("--have-interval", type=float, default=None, help="peerd's --have-interval (default: peerd's own)")
    p.add_argument("--no-have-stream", dest="have_stream", action="store_false",
                   help="peerd's --no-have-stream: pushes as HTTP POSTs (the A/B of docs/peerd.md)")
    p.add_argument("--deadline", type=float, default=None, help="seconds per swarm before giving up (default 60 + 5 S/R)")
    p.add_argument("--no-warm-pages", dest="warm_pages", action="store_false", help=WARM_HELP)
    p.add_argument("--json", action="store_true")


def _training_bench_flags(p, *, steps: int) -> None:
    """The flags every training benchmark takes."""
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TrainConfig overrides")
    p.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast", description="Roll model checkpoints out to a GPU fleet.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    keys = sub.add_parser("keys", help="manifest signing keys").add_subparsers(dest="sub", required=True)
    g = keys.add_parser("generate", help="create an Ed25519 key pair")
    g.add_argument("--out", type=Path, default=Path("."), help="directory for manifest-signing.{pem,pub}")
    g.set_defaults(fn=cmd_keys_generate)

    man = sub.add_parser("manifest", help="build and verify signed manifests").add_subparsers(dest="sub", required=True)
    b = man.add_parser("build", help="hash a checkpoint (directory or s3://bucket/prefix) and sign it")
    b.add_argument("source")
    b.add_argument("--model", required=True)
    b.add_argument("--version", required=True)
    b.add_argument("--key", type=Path, required=True, help="Ed25519 private key (PEM)")
    b.add_argument("--chunk-size", type=parse_size, default=mf.DEFAULT_CHUNK_SIZE, help="default 64MiB")
    b.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    b.add_argument("--endpoint", default=None, help="S3 endpoint URL for s3:// sources")
    b.add_argument("--out", type=Path, default=Path("manifest.json"))
    b.set_defaults(fn=cmd_manifest_build)
    v = man.add_parser("verify", help="check a manifest's signature (and optionally a directory's files)")
    v.add_argument("manifest", type=Path)
    v.add_argument("--trusted-key", type=Path, action="append", required=True)
    v.add_argument("--dir", type=Path, help="also re-hash the files in this directory")
    v.set_defaults(fn=cmd_manifest_verify)

    s = sub.add_parser("sim", help="simulate the swarm at fleet scale (peerd's rules over a fluid link model)")
    s.add_argument("--engine", choices=("fleet", "policies"), default="fleet",
                   help="fleet: batched rules, 10,000 hosts; policies: one SwarmPolicy object per host (small fleets)")
    s.add_argument("--hosts", type=int, default=1000)
    s.add_argument("--size", type=parse_size, default=parse_size("400GB"))
    s.add_argument("--chunk", type=parse_size, default=parse_size("64M"))
    s.add_argument("--rate", type=parse_rate, default=parse_rate("10Gbit"))
    s.add_argument("--racks", type=int, default=20)
    s.add_argument("--oversubscription", type=float, default=1.0, help="rack uplink = hosts x rate / this")
    s.add_argument("--fail", type=float, default=0.05, help="fraction of hosts that die mid-run")
    s.add_argument("--seeders", type=int, default=MAX_SEEDERS,
                   help=f"hosts that read the origin, round-robin over the racks (default {MAX_SEEDERS}, as a rollout)")
    s.add_argument("--seed", type=int, default=1)
    # peerd's own settings: defaults are peerd's (PolicyConfig, PeerdConfig); names are theirs
    pol = PolicyConfig()
    for name in _SIM_POLICY_FLAGS:
        s.add_argument("--" + name.replace("_", "-"), type=type(getattr(pol, name)), default=getattr(pol, name),
                       help=f"PolicyConfig.{name} (default %(default)s)")
    for name in _SIM_PEERD_FLAGS:
        d = peerd_default(name)
        s.add_argument("--" + name.replace("_", "-"), type=type(d), default=d, help=f"peerd's {name} (default %(default)s)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_sim)

    bench = sub.add_parser("bench", help="benchmarks (print JSON)").add_subparsers(dest="sub", required=True)
    bs = bench.add_parser("swarm", help="real peerd processes on loopback, origin in SeaweedFS")
    _swarm_flags(bs, hosts=8, size="256M", rate="16M", chunk="1M", kill=0, corrupt=0)
    bs.add_argument("--netns", action="store_true",
                    help="each host and the origin in a network namespace behind a kernel-shaped link (root only)")
    bs.add_argument("--racks", type=positive_int, default=1, help="--netns: hosts split evenly over racks")
    bs.add_argument("--oversubscription", type=float, default=1.0,
                    help="--netns: a rack's uplink carries its hosts x rate / this")
    bs.add_argument("--partition", dest="partition_s", type=float, default=0.0,
                    help="--netns: cut the last rack from the spine for this many seconds, from 0.3 x S/R")
    bs.add_argument("--link-down", dest="link_down_s", type=float, default=0.0,
                    help="--netns: the last host's link down for this many seconds, from 0.3 x S/R")
    bs.add_argument("--loss", type=float, default=0.0,
                    help="--netns: share of packets each host drops on arrival, e.g. 0.01 (nftables: make netns-tools)")
    bs.set_defaults(fn=cmd_bench_swarm)

    bm = bench.add_parser("manifest", help="manifest cost at real chunk counts: parse, verify, layout, status; time and RSS")
    bm.add_argument("--chunks", default="6000,60000,400000", help="comma-separated chunk counts")
    bm.add_argument("--files", type=int, default=64, help="files the checkpoint is split into")
    bm.add_argument("--json", action="store_true")
    bm.set_defaults(fn=cmd_bench_manifest)

    ba = bench.add_parser("allreduce", help="gradient methods side by side, each rank behind its own kernel-shaped link (netns)")
    _training_bench_flags(ba, steps=30)
    ba.add_argument("--link", type=parse_rate, default=parse_rate("1Gbit"), help="the link's rate, e.g. 1Gbit")
    ba.set_defaults(fn=cmd_bench_allreduce)

    bp = bench.add_parser("throughput", help="peerd's cost per byte: one server, N downloaders, no limits; "
                                             "MiB/s and CPU-s/GiB per process (put TMPDIR on /dev/shm)")
    bp.add_argument("--size", type=parse_size, default=parse_size("1G"))
    bp.add_argument("--chunk", type=parse_size, default=parse_size("4M"))
    bp.add_argument("--downloaders", type=positive_int, default=1)
    bp.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    bp.add_argument("--no-warm-pages", dest="warm_pages", action="store_false", help=WARM_HELP)
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(fn=cmd_bench_throughput)

    bv = bench.add_parser("receive", help="receive-side CPU per GiB: aiohttp (peerd today) vs a BufferedProtocol "
                                          "into one pre-allocated chunk buffer, alternating")
    bv.add_argument("--size", type=parse_size, default=parse_size("64M"), help="body (chunk) size")
    bv.add_argument("--count", type=positive_int, default=16, help="chunks per round and way")
    bv.add_argument("--rounds", type=positive_int, default=3)
    bv.add_argument("--json", action="store_true")
    bv.set_defaults(fn=cmd_bench_receive)
    bg = bench.add_parser("gossip", help="CPU of one push exchange with a real peerd: HTTP POST /v1/gossip vs a "
                                         "frame on a HAVE link, alternating")
    bg.add_argument("--exchanges", type=positive_int, default=3000, help="exchanges per round and way")
    bg.add_argument("--rounds", type=positive_int, default=2)
    bg.add_argument("--peers", type=positive_int, default=15, help="members pushing at once")
    bg.add_argument("--json", action="store_true")
    bg.set_defaults(fn=cmd_bench_gossip)
    br = bench.add_parser("rebalance", help="one slow data-parallel rank: equal shares vs rebalanced vs balanced")
    _training_bench_flags(br, steps=30)
    br.add_argument("--slowdown", type=float, default=2.0, help="the last rank computes this many times slower")
    br.add_argument("--batch-per-rank", type=int, default=16)
    br.add_argument("--link", type=parse_rate, default=None,
                    help="each rank in its own network namespace behind a kernel-shaped link of this rate")
    br.set_defaults(fn=cmd_bench_rebalance)

    bt = bench.add_parser("train", help="tokens/s of each parallelism layout, side by side")
    _training_bench_flags(bt, steps=20)
    bt.add_argument("--layouts", default="single,ddp,fsdp,tp,pp,fsdp_tp",
                    help="comma-separated layouts (fsdp_tp uses tp_degree=2 and needs --ranks 4)")
    bt.add_argument("--model", choices=("reference", "llama"), default="reference",
                    help="the model trained: weightcast's reference transformer or a Llama (transformers)")
    bt.set_defaults(fn=cmd_bench_train)
    btr = bench.add_parser("train-recovery", help="a rank killed mid-run: TrainingWorkflow vs torchrun --max-restarts")
    btr.add_argument("--ranks", type=positive_int, default=2)
    btr.add_argument("--steps", type=positive_int, default=60)
    btr.add_argument("--kill-at", type=positive_int, default=33, help="SIGKILL rank 1 once it has finished this step")
    btr.add_argument("--every", type=positive_int, default=10, help="steps between checkpoints (both systems)")
    btr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="TrainConfig overrides of the benchmark's model (default 28.6 MiB of weights)")
    btr.add_argument("--json", action="store_true")
    btr.set_defaults(fn=cmd_bench_train_recovery)

    sk = bench.add_parser("soak", help="many swarms back to back with kills and corrupt peers; counts crashed daemons")
    sk.add_argument("--swarms", type=int, default=10)
    _swarm_flags(sk, hosts=16, size="32M", rate="8M", chunk="256K", kill=1, corrupt=1)
    sk.set_defaults(fn=cmd_bench_soak)

    bl = bench.add_parser("load", help="model load throughput vs page-cache read of the same files")
    bl.add_argument("--size", type=parse_size, default=parse_size("256M"))
    bl.add_argument("--repeats", type=int, default=3)
    bl.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    bl.add_argument("--engine", choices=("reference", "transformers"), default="reference",
                    help="reference: weightcast's own transformer; transformers: a Hugging Face Llama directory")
    bl.add_argument("--json", action="store_true")
    bl.set_defaults(fn=cmd_bench_load)

    be = bench.add_parser("engine", help="a new version ready in a running engine (verified, golden prompts "
                                         "passed) vs a cold start of that engine, same run")
    be.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    be.add_argument("--json", action="store_true")
    be.set_defaults(fn=cmd_bench_engine)

    bq = bench.add_parser("router", help="time to first token of streamed completions through the router vs the "
                                         "engine called directly, alternating, same run")
    bq.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    bq.add_argument("--requests", type=int, default=200, help="streamed requests on each path")
    bq.add_argument("--json", action="store_true")
    bq.set_defaults(fn=cmd_bench_router)

    br = bench.add_parser("rollout", help="a whole rollout on the embedded stack vs the byte-moving lower bound")
    br.add_argument("--hosts", type=int, default=4)
    br.add_argument("--size", type=parse_size, default=parse_size("64M"))
    br.add_argument("--rate", type=parse_rate, default=parse_rate("16M"))
    br.add_argument("--step-wait", type=float, default=0.0, help="dwell at each traffic step (s)")
    br.add_argument("--json", action="store_true")
    br.set_defaults(fn=cmd_bench_rollout)

    bh = bench.add_parser("rollout-shape", help="a rollout's histories at fleet size (light host activities, the real "
                                                "workflow and dev server): largest payload, longest history, wall time")
    bh.add_argument("--hosts", type=positive_int, default=10_000)
    bh.add_argument("--racks", type=positive_int, default=200)
    bh.add_argument("--max-loads", type=positive_int, default=100, help="the rollout's max_concurrent_loads")
    bh.add_argument("--max-history-events", type=positive_int, default=20_000, help="continue-as-new past this")
    bh.add_argument("--json", action="store_true", help="(the output is always JSON)")
    bh.set_defaults(fn=cmd_bench_rollout_shape)

    gc = sub.add_parser("gpu-check", help="on a CUDA host: verified load to the GPU, both engines in bf16, one "
                                          "rollout; prints JSON (exit 2 without CUDA)")
    gc.set_defaults(fn=cmd_gpu_check)

    pb = sub.add_parser("publish", help="CI/CD: upload a checkpoint, sign its manifest, start its rollout (idempotent)")
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

    dv = sub.add_parser("dev", help="the embedded stack, kept running").add_subparsers(dest="sub", required=True)
    du = dv.add_parser("up", help="start Temporal (UI), SeaweedFS, N hosts, router, workers on 127.0.0.1")
    du.add_argument("--hosts", type=int, default=4)
    du.add_argument("--rate", type=parse_rate, default=parse_rate("16M"))
    du.add_argument("--temporal-port", type=int, default=7233)
    du.add_argument("--ui-port", type=int, default=8233)
    dd = dv.add_parser("down", help="stop the stack that `dev up` started")
    for p in (du, dd):
        p.add_argument("--dir", type=Path, default=Path(".weightcast-dev"))
        p.set_defaults(fn=cmd_dev)

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
                                "through peerd's swarm (the host workers need --peerd, --token and --store)")
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

    d = sub.add_parser("demo", help="a real end-to-end distribution on loopback")
    d.add_argument("--hosts", type=int, default=4)
    d.add_argument("--size", type=parse_size, default=parse_size("48M"))
    d.add_argument("--rate", type=parse_rate, default=parse_rate("16M"))
    d.add_argument("--train-steps", type=int, default=150,
                   help="train a Llama this many steps first (one rank killed halfway) and roll it out; 0: roll out "
                        "a Llama built here")
    d.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                   help="what runs the Hugging Face Llama the demo rolls out (`make demo`: vllm, from make vllm-venv)")
    d.add_argument("--keep-ui", type=float, default=0.0, help="seconds to keep the stack (and UI) up at the end")
    d.add_argument("--keep", action="store_true",
                   help="keep the stack up until Enter/Ctrl-C (the default at a terminal; not under CI=true)")
    d.set_defaults(fn=cmd_demo)
    return ap


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: finally blocks stop the daemons and servers a command started (only a
    # main thread may set handlers: called from another thread, the caller owns the signals)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return a.fn(a)
    except (mf.ManifestError, KeyError_) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from weightcast.publish import PublishError
        from weightcast.rollouts import InvalidRolloutInput
        from weightcast.demo import DemoFailed
        from weightcast.stack.dev import DevError
        from training.config import ConfigError
        from bench.allreduce import NamespaceError
        if isinstance(e, (PublishError, InvalidRolloutInput, DevError, TemporalUnreachable, DemoFailed, ConfigError,
                          NamespaceError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


def entry() -> None:
    """The `weightcast` console script. After a command that used a Temporal client, leave without
    interpreter finalization: the SDK's Rust runtime threads can touch the GIL while CPython tears
    down and abort the process with "PyGILState_Release ... finalizing" after the command already
    succeeded (temporalio/sdk-python#300; seen with `rollout rollback` and `rollout status --watch`)."""
    rc = main()
    if not _TEMPORAL_USED:
        sys.exit(rc)
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    entry()
