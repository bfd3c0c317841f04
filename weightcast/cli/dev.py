"""`weightcast dev up|down` and `weightcast demo`: the embedded stack."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path

from peerd.units import parse_rate, parse_size
from weightcast.cli.common import Progress


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


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
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
