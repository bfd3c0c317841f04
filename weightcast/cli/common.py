"""What the command areas share: progress lines, Temporal connections, watching a rollout, flag types."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


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


class TemporalUnreachable(RuntimeError):
    pass


WARM_HELP = ("skip writing and freeing the bytes the daemons will store before the clock starts (on a VM, "
             "memory not touched lately costs ~10x more to write the first time; that then lands in the run)")


HASH_HELP = ("chunk digests: sha256 (default) or blake3 (about a quarter of the CPU per byte on every host "
             "that receives, serves or loads it); the version id stays the SHA-256 of the signed manifest")


_TEMPORAL_USED = False    # a Temporal client was made in this process (see entry())


def operator_identity() -> str:
    import getpass
    import socket
    try:
        user = getpass.getuser()
    except (KeyError, OSError):          # no passwd entry (some containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()} (weightcast cli, pid {os.getpid()})"


async def connect(address: str, namespace: str):
    from temporalio.client import Client
    global _TEMPORAL_USED
    _TEMPORAL_USED = True
    try:
        # the identity lands in the history with every signal and update: who paused or aborted
        return await Client.connect(address, namespace=namespace, identity=operator_identity())
    except RuntimeError as e:   # the SDK reports every connect failure as RuntimeError
        raise TemporalUnreachable(f"cannot reach Temporal at {address} (namespace {namespace}): {e}; start it "
                                  "(`weightcast dev up`) or pass --temporal HOST:PORT") from None


WATCH_PAUSED = 4          # `--wait`/`--watch` exit code: the rollout waits for an operator


async def watch_rollout(client, workflow_id: str) -> int:
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


def print_started(handle) -> None:
    """What CI keeps from a start: the workflow's id and run."""
    print(json.dumps({"workflow_id": handle.id, "run_id": handle.result_run_id}))


def positive_int(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def run_steering(go) -> int:
    """Run ``go()``, a command that steers a workflow; an update the workflow refused is exit 2 with its
    reason (other failures are the caller's)."""
    from temporalio.client import WorkflowUpdateFailedError
    try:
        return asyncio.run(go())
    except WorkflowUpdateFailedError as e:
        print(f"error: refused: {e.cause}", file=sys.stderr)
        return 2


def temporal_used() -> bool:
    """Whether this process made a Temporal client (``entry`` then leaves without finalization)."""
    return _TEMPORAL_USED
