"""`weightcast keys`: manifest signing keys."""
from __future__ import annotations

import json
from pathlib import Path

from peerd.signing import generate_keypair


def cmd_keys_generate(a) -> int:
    generate_keypair(a.out / "manifest-signing.pem", a.out / "manifest-signing.pub")
    print(json.dumps({"private_key": str(a.out / "manifest-signing.pem"),
                      "public_key": str(a.out / "manifest-signing.pub")}))
    return 0


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
    keys = sub.add_parser("keys", help="manifest signing keys").add_subparsers(dest="sub", required=True)
    g = keys.add_parser("generate", help="create an Ed25519 key pair")
    g.add_argument("--out", type=Path, default=Path("."), help="directory for manifest-signing.{pem,pub}")
    g.set_defaults(fn=cmd_keys_generate)
