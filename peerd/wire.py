"""Wire formats shared by the daemon and its clients: bitmaps and schema checks for JSON bodies."""
from __future__ import annotations

import base64
import re

import numpy as np

MAX_GOSSIP_BYTES = 1 * 1024 * 1024
MAX_JOB_BYTES = 64 * 1024 * 1024
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}\Z")
_VID = re.compile(r"^[0-9a-f]{64}\Z")
_ADDR = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]{1,256}\Z")


class WireError(ValueError):
    """A request body does not match its schema; the message says which field and why."""


def pack_bits(bits: np.ndarray) -> str:
    return base64.b64encode(np.packbits(bits.astype(bool)).tobytes()).decode()


def unpack_bits(s: str, n: int) -> np.ndarray:
    try:
        raw = base64.b64decode(s, validate=True)
    except (ValueError, TypeError):
        raise WireError("bitmap is not valid base64") from None
    if len(raw) != (n + 7) // 8:
        raise WireError(f"bitmap has {len(raw)} bytes; {n} chunks need {(n + 7) // 8}")
    return np.unpackbits(np.frombuffer(raw, np.uint8), count=n).astype(bool)


def check_id(v, what: str = "id") -> str:
    if not isinstance(v, str) or not _ID.match(v):
        raise WireError(f"{what} {v!r} must match {_ID.pattern}")
    return v


def check_vid(v) -> str:
    if not isinstance(v, str) or not _VID.match(v):
        raise WireError(f"version id {v!r} must be 64 lowercase hex characters")
    return v


def check_peer(d) -> dict:
    if not isinstance(d, dict):
        raise WireError("a peer must be an object with id, addr and rack")
    addr = d.get("addr")
    if not isinstance(addr, str) or not _ADDR.match(addr):
        raise WireError(f"peer addr {addr!r} must be http(s)://host:port")
    rack = d.get("rack", "")
    if not isinstance(rack, str) or len(rack) > 128:
        raise WireError("peer rack must be a string of at most 128 characters")
    return {"id": check_id(d.get("id"), "peer id"), "addr": addr, "rack": rack}


def check_gossip(body) -> dict:
    if not isinstance(body, dict):
        raise WireError("gossip body must be a JSON object")
    sender = check_peer(body.get("from"))
    versions = body.get("versions", {})
    if not isinstance(versions, dict) or len(versions) > 64:
        raise WireError("versions must be an object of at most 64 version ids")
    for k, v in versions.items():
        check_vid(k)
        if not isinstance(v, str):
            raise WireError("each version's bitmap must be a base64 string")
    peers = body.get("peers", [])
    if not isinstance(peers, list) or len(peers) > 256:
        raise WireError("peers must be a list of at most 256 peers")
    return {"from": sender, "versions": versions, "peers": [check_peer(p) for p in peers],
            "load": _check_load(body.get("load"))}


def check_have(body) -> dict:
    """A HAVE-stream news frame: ``{"have": {vid: [chunk, ...]}, "load": x}`` (peerd/have_stream.py).
    Chunk ids are checked against each version's manifest where the version is known."""
    have = body.get("have") if isinstance(body, dict) else None
    if not isinstance(have, dict) or len(have) > 64:
        raise WireError("have must be an object of at most 64 version ids, each with a list of chunk ids")
    for k, v in have.items():
        check_vid(k)
        if not isinstance(v, list) or not all(type(c) is int and c >= 0 for c in v):
            raise WireError(f"have[{k[:12]}…] must be a list of chunk ids (integers >= 0)")
    return {"have": have, "load": _check_load(body.get("load"))}


def _check_load(load) -> float | None:
    if load is not None and (isinstance(load, bool) or not isinstance(load, (int, float)) or not 0 <= load <= 1e3):
        raise WireError("load must be a number >= 0 (the share of upload slots in use)")
    return None if load is None else float(load)


def check_job(body) -> dict:
    if not isinstance(body, dict):
        raise WireError("job body must be a JSON object")
    pinned, adopt = body.get("pinned", False), body.get("adopt", False)
    if not isinstance(pinned, bool) or not isinstance(adopt, bool):
        raise WireError("pinned and adopt must be true or false")
    ref = body.get("manifest_ref")
    if ref is not None:
        if not isinstance(ref, dict) or not isinstance(ref.get("key", ""), str) or len(ref.get("key", "")) > 1024 \
                or not (pinned or ref.get("key")):
            raise WireError("manifest_ref must be {version_id, key}: the signed manifest's id and object key")
        ref = {"version_id": check_vid(ref.get("version_id")), "key": ref.get("key", "")}
        if "manifest" in body:
            raise WireError("give 'manifest' (the document) or 'manifest_ref' (where it lies), not both")
        if body.get("origin") is None and not pinned:
            raise WireError("manifest_ref needs an origin to fetch the manifest from")
    elif not isinstance(body.get("manifest"), dict):
        raise WireError("job needs 'manifest_ref' {version_id, key} (or 'manifest', the signed document)")
    origin = body.get("origin")
    if origin is not None:
        if not isinstance(origin, dict) or not all(isinstance(origin.get(k), str) for k in ("endpoint", "bucket")):
            raise WireError("origin must be an object with string endpoint and bucket (and optional prefix)")
        if not isinstance(origin.get("prefix", ""), str):
            raise WireError("origin prefix must be a string")
    seeders = body.get("seeders", [])
    if not isinstance(seeders, list) or len(seeders) > 100_000:
        raise WireError("seeders must be a list of host ids")
    peers = body.get("peers", [])
    if not isinstance(peers, list) or len(peers) > 100_000:
        raise WireError("peers must be a list")
    return {"manifest": body.get("manifest"), "manifest_ref": ref, "origin": origin,
            "seeders": [check_id(s, "seeder id") for s in seeders], "peers": [check_peer(p) for p in peers],
            "pinned": pinned, "adopt": adopt}
