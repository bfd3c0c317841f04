"""Manifests by reference: fetch one from object storage (or a peer) and prove it is the one named.
The reference is (version id, object key); the version id is the SHA-256 of the canonical body, so
whoever serves the bytes need not be trusted: digest and signature are both checked here. A *pinned*
version (a training checkpoint, docs/trust.md) has no signature: the authenticated caller named its
id, and the digest alone proves the body is the one named."""
from __future__ import annotations

import asyncio
import json

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


def _pinned(raw: bytes) -> mf.Manifest:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise mf.ManifestError(f"manifest is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or "manifest" not in doc:
        raise mf.ManifestError("a manifest document holds its body under 'manifest'")
    return mf.parse_body(doc["manifest"])


async def verify_pinned(raw: bytes, version_id: str, where: str) -> mf.Manifest:
    """A pinned manifest: any body that hashes to ``version_id`` (signed or not)."""
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise mf.ManifestError(f"the manifest at {where} is over the {mf.MAX_MANIFEST_BYTES}-byte limit")
    m = await asyncio.to_thread(_pinned, raw)
    if m.digest != version_id:
        raise mf.ManifestError(f"the manifest at {where} is version {m.digest[:12]}…, not the pinned {version_id[:12]}…")
    return m


def pinned_document(body: dict) -> bytes:
    """How a pinned version's manifest is stored and served: marked so it can never pass as signed."""
    return json.dumps({"manifest": body, "pinned": True}).encode()


async def fetch_from_origin(origin: S3Origin, key: str, version_id: str,
                            trusted: list[Ed25519PublicKey]) -> tuple[mf.Manifest, bytes]:
    where = f"s3://{origin.spec.bucket}/{origin.spec.key(key)}"
    raw = await origin.read_object(key)     # OriginError (transient) propagates: worth a retry
    if raw is None:
        raise mf.ManifestError(f"no manifest at {where}; publish the checkpoint first (`weightcast publish`)")
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise mf.ManifestError(f"{where} is {len(raw)} bytes, over the {mf.MAX_MANIFEST_BYTES}-byte manifest limit")
    return await verify_named(raw, version_id, trusted, where), raw
