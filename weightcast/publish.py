"""`weightcast publish` (CI/CD, after training): upload a checkpoint to object storage, build and sign
its manifest, and start its rollout. Safe to retry at every step:

- the manifest is built from the local directory and signed;
- ``<prefix>/.weightcast-manifest.json`` is written last and marks a finished upload. If it already
  describes the same files and chunks, the upload is skipped and that signed manifest (and so its
  version id) is reused; if it describes other bytes the version name is taken and publishing is
  refused (versions are immutable: publish a new version);
- the rollout starts idempotently (``start_rollout``): a retried job attaches to the running rollout,
  and a finished one is reported, never started again.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError
from temporalio.client import Client
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from peerd import manifest as mf
from peerd.origin import OriginError, OriginSpec, S3Origin
from peerd.signing import load_private_key
from weightcast.rollouts import check_input, rollout_id, start_rollout
from workflows.types import HostSpec, ManifestRef, RolloutInput

MARKER = ".weightcast-manifest.json"


class PublishError(RuntimeError):
    pass


@dataclass
class PublishRequest:
    source: Path                    # the checkpoint directory written by training
    model: str
    version: str
    key: Path                       # Ed25519 private key (PEM) that the fleet trusts
    origin: OriginSpec              # where the bytes go: s3://bucket/prefix at endpoint
    chunk_size: int = mf.DEFAULT_CHUNK_SIZE
    access_key: str | None = None   # default: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    secret_key: str | None = None


@dataclass
class Published:
    manifest: mf.Manifest
    signed: str
    uploaded: list[str] = field(default_factory=list)
    already_there: bool = False


async def upload(req: PublishRequest) -> Published:
    if not req.source.is_dir():
        raise PublishError(f"{req.source} is not a directory; give the checkpoint directory training wrote")
    key = load_private_key(req.key)
    m = await asyncio.to_thread(mf.build_from_directory, req.source, req.model, req.version, req.chunk_size)
    signed = mf.signed_bytes(m, key)
    where = f"s3://{req.origin.bucket}/{req.origin.prefix}"
    try:
        return await _upload_to_bucket(req, m, signed, key, where)
    except (BotoCoreError, ClientError, OriginError) as e:
        raise PublishError(f"object storage at {req.origin.endpoint} ({where}): {e}; check --endpoint, --bucket "
                           "and the AWS_* credentials") from None


async def _upload_to_bucket(req: PublishRequest, m: mf.Manifest, signed: bytes, key, where: str) -> Published:
    async with S3Origin(req.origin, req.access_key, req.secret_key) as o:
        await o.ensure_bucket()
        prior = await o.read_object(MARKER)
        if prior is not None:
            try:
                prior_m = mf.load_signed(prior, [key.public_key()])
            except mf.ManifestError as e:
                raise PublishError(f"{where} already holds a manifest this key cannot verify ({e}); "
                                   "versions are immutable: publish under a new version or prefix") from None
            if (prior_m.files, prior_m.chunks, prior_m.chunk_size) != (m.files, m.chunks, m.chunk_size):
                raise PublishError(f"{req.model}/{req.version} is already published at {where} with different "
                                   f"contents (version id {prior_m.digest[:12]}); versions are immutable: publish "
                                   "under a new version")
            return Published(prior_m, prior.decode(), [], already_there=True)
        uploaded = await o.upload_directory(req.source)
        await o.put_bytes(o.spec.key(MARKER), signed)     # last: only a complete upload is marked
    return Published(m, signed.decode(), uploaded)


async def publish_and_start(client: Client, req: PublishRequest, hosts: list[HostSpec], **rollout: object) -> dict:
    """Upload, sign, start (or attach to) the rollout. ``rollout`` takes RolloutInput's optional fields
    (router, previous_version, max_concurrent_loads, failure_budget, ...)."""
    origin = {"endpoint": req.origin.endpoint, "bucket": req.origin.bucket, "prefix": req.origin.prefix}
    # refuse bad input before uploading anything (the manifest is not signed yet: a placeholder stands in)
    check_input(RolloutInput(req.model, req.version, "", origin, hosts, manifest=ManifestRef("0" * 64, MARKER),
                             **rollout), "nothing published")
    pub = await upload(req)
    # by reference: the workflow and every host activity carry (digest, key), never the document
    inp = RolloutInput(req.model, req.version, "", origin, hosts, manifest=ManifestRef(pub.manifest.digest, MARKER),
                       **rollout)
    wid = rollout_id(req.model, req.version)
    out = {"model": req.model, "version": req.version, "version_id": pub.manifest.digest, "workflow_id": wid,
           "bytes": pub.manifest.total_size, "uploaded_files": len(pub.uploaded),
           "upload": "skipped (already published)" if pub.already_there else "done"}
    try:
        before = await client.get_workflow_handle(wid).describe()
        out["rollout"] = "attached" if before.status is not None and before.status.name == "RUNNING" else "exists"
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        out["rollout"] = "started"
    try:
        await start_rollout(client, inp)
    except WorkflowAlreadyStartedError:
        desc = await client.get_workflow_handle(wid).describe()
        out["rollout"] = f"already finished ({desc.status.name}); not started again"
        out["previous_outcome"] = desc.status.name
    return out


def hosts_from_file(path: Path) -> list[HostSpec]:
    """The fleet inventory: a JSON list of {"id", "model_server", "rack"} objects."""
    try:
        raw = json.loads(path.read_text())
        return [HostSpec(**h) for h in raw]
    except (OSError, ValueError, TypeError) as e:
        raise PublishError(f"{path}: not a host list ({e}); expected JSON like "
                           '[{"id": "gpu-001", "model_server": "http://10.0.0.1:8100", "rack": "r1"}]') from None
