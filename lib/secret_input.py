"""Secrets reach a process from its environment or from a file, never from its command line, which
any user of the machine can read (`ps`, /proc/<pid>/cmdline)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

# the two secrets of a fleet (docs/trust.md): the cluster token (peerd, host workers) and the admin token
CLUSTER_TOKEN = "WEIGHTCAST_TOKEN"
ADMIN_TOKEN = "WEIGHTCAST_ADMIN_TOKEN"


def add_secret_file_arg(ap: argparse.ArgumentParser, env: str, what: str) -> None:
    """``--<name>-file``: where the secret ``env`` is read from when that variable is not set."""
    flag = "--" + env.removeprefix("WEIGHTCAST_").lower().replace("_", "-") + "-file"
    ap.add_argument(flag, type=Path, dest=_dest(env), metavar="PATH",
                    help=f"a file holding the {what} (default: ${env}); never a flag of its own, so `ps` cannot "
                         "show it")


def read_secret(a: argparse.Namespace, env: str) -> str:
    """The secret from ``$env``, else from the file its flag names (trailing newline stripped), else ''."""
    if os.environ.get(env):
        return os.environ[env]
    path = getattr(a, _dest(env), None)
    if path is None:
        return ""
    try:
        return path.read_text().strip()
    except OSError as e:
        raise SystemExit(f"cannot read the secret file {path}: {e}") from None


def _dest(env: str) -> str:
    return env.lower() + "_file"
