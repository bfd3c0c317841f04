"""Signed manifests by reference: fetch one from object storage (or a peer) and prove it is the one
named. The reference is (version id, object key); the version id is the SHA-256 of the canonical body,
so whoever serves the bytes need not be trusted: digest and signature are both checked here."""
from __future__ import annotations

import asyncio

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from peerd import manifest as mf
from peerd.origin import S3Origin


async def verify_named(raw: bytes, version_id: str, trusted: list[Ed25519PublicKey], where: str) -> mf.Manifest:
    """Parse and check a signed manifest off the event loop (MBs of JSON at full size); it must hash to
    ``version_id``."""
    m = await asyncio.to_thread(mf.load_signed, raw, trusted)
    if m.digest != version_id:
        raise mf.ManifestError(f"the manifest at {where} is version {m.digest[:12]}…, not the requested "
                               f"{version_id[:12]}…: was the prefix re-published? Start the rollout with its id")
    return m


async def fetch_from_origin(origin: S3Origin, key: str, version_id: str,
                            trusted: list[Ed25519PublicKey]) -> tuple[mf.Manifest, bytes]:
    where = f"s3://{origin.spec.bucket}/{origin.spec.key(key)}"
    raw = await origin.read_object(key)     # OriginError (transient) propagates: worth a retry
    if raw is None:
        raise mf.ManifestError(f"no manifest at {where}; publish the checkpoint first (`weightcast publish`)")
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise mf.ManifestError(f"{where} is {len(raw)} bytes, over the {mf.MAX_MANIFEST_BYTES}-byte manifest limit")
    return await verify_named(raw, version_id, trusted, where), raw
