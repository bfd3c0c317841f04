"""The `weightcast` command line: each area (keys, manifest, bench, rollout, train, dev) registers its own
subcommands; this module builds the parser and runs a command."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from peerd import manifest as mf
from peerd.signing import KeyError_
from weightcast.cli import bench, dev, keys, manifest, rollout, train
from weightcast.cli.common import TemporalUnreachable, temporal_used


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="weightcast", description="Roll model checkpoints out to a GPU fleet.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for area in (keys, manifest, bench, rollout, train, dev):
        area.register(sub)
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
    if not temporal_used():
        sys.exit(rc)
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)
