"""`weightcast manifest build|verify`: signed manifests from a directory or S3."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from peerd import manifest as mf
from peerd.digests import ALGORITHMS
from peerd.signing import load_private_key, load_public_key
from peerd.units import parse_size
from weightcast.cli.common import HASH_HELP


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


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
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
