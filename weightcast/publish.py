"""`weightcast publish` (CI/CD, after training): upload a checkpoint to object storage, build and sign
its manifest, and start its rollout. Safe to retry at every step:

- nothing is uploaded until the pre-checks pass: the checkpoint's own version label matches the
  version being published, and the control worker (the one that will check the real manifest) trusts
  the signing key and can reach the router with its admin token (``PreflightWorkflow``);
- the manifest is built from the local directory and signed;
- ``<prefix>/.weightcast-manifest.json`` is written last and marks a finished upload. If it already
  describes the same files and chunks, the upload is skipped and that signed manifest (and so its
  version id) is reused; if it describes other bytes the version name is taken and publishing is
  refused (versions are immutable: publish a new version);
- the host list goes next to the manifest, named by its SHA-256; the rollout carries only that
  reference (a 10,000-host list inline would be the largest payload of its history);
- the rollout starts idempotently (``start_rollout``): a retried job attaches to the running rollout,
  and a finished one is reported, never started again.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import TimeoutError as TemporalTimeout, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities import inventory
from peerd import manifest as mf
from peerd.origin import OriginError, OriginSpec, S3Origin
from peerd.signing import load_private_key
from serving import golden
from serving.checkpoint import SMOKE
from serving.hf_engine import is_hf_checkpoint
from weightcast.rollouts import InvalidRolloutInput, rollout_id, start_rollout
from workflows.preflight import PreflightWorkflow
from workflows.types import CONTROL_QUEUE, HostSpec, ManifestRef, PreflightInput, RolloutInput, host_problems

MARKER = ".weightcast-manifest.json"
PREFLIGHT_TIMEOUT = timedelta(seconds=60)


class PublishError(RuntimeError):
    """Nothing (more) was published; the message says why and what to do. ``retryable``: a fault of
    the moment (object storage unreachable), not of the request."""

    def __init__(self, msg: str, retryable: bool = False):
        super().__init__(msg)
        self.retryable = retryable


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
    hash_algorithm: str = mf.HASH_ALGORITHM     # chunk digests: sha256, or blake3 (cheaper per byte)


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
    serving = {"golden": await asyncio.to_thread(golden_prompts, req.source)} if is_hf_checkpoint(req.source) else None
    m = await asyncio.to_thread(mf.build_from_directory, req.source, req.model, req.version, req.chunk_size,
                                req.hash_algorithm, serving)
    signed = mf.signed_bytes(m, key)
    where = f"s3://{req.origin.bucket}/{req.origin.prefix}"
    try:
        return await _upload_to_bucket(req, m, signed, key, where)
    except (BotoCoreError, ClientError, OriginError) as e:
        raise PublishError(f"object storage at {req.origin.endpoint} ({where}): {e}; check --endpoint, --bucket "
                           "and the AWS_* credentials", retryable=True) from None


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


def golden_prompts(source: Path) -> dict:
    """A Hugging Face checkpoint's golden prompts (serving/golden.py), recorded here on the CPU."""
    try:
        return golden.record(source)
    except golden.GoldenError as e:
        raise PublishError(f"{e}; nothing published") from None
    except (OSError, ValueError) as e:
        raise PublishError(f"{source} is not a checkpoint transformers can load ({type(e).__name__}: {e}); "
                           "nothing published") from None


def check_label(req: PublishRequest) -> None:
    """The checkpoint says which version it is (its smoke material, checked again at load): publishing
    it under another name would ship it everywhere and then fail every load as wrong_version. A Hugging
    Face directory carries no label: its golden prompts, recorded at upload, identify it."""
    if is_hf_checkpoint(req.source):
        return
    smoke = req.source / SMOKE
    if not smoke.is_file():
        raise PublishError(f"{req.source} has no {SMOKE}: the model server loads only checkpoints with their "
                           "smoke material (serving.checkpoint.write_checkpoint writes it); nothing published")
    try:
        label = json.loads(smoke.read_text()).get("version", "")
    except (OSError, ValueError, AttributeError) as e:
        raise PublishError(f"{smoke} is unreadable ({e}); nothing published") from None
    if label and label != req.version:
        raise PublishError(f"the checkpoint in {req.source} is version {label!r} (its {SMOKE}), not {req.version!r}: "
                           f"publish it as --version {label} or re-export it; nothing published")


def signed_probe(key, model: str, version: str) -> str:
    """A tiny manifest signed with the publishing key: the control worker checks it trusts the key."""
    probe = mf.build_from_pieces(model, version, 1024, [("preflight-probe", [b"weightcast preflight"])])
    return mf.signed_bytes(probe, key).decode()


async def preflight(client: Client, req: PublishRequest, router: str = "", previous_version: str = "") -> None:
    """Ask the control worker before uploading: does it trust this key, can it drive the router?"""
    inp = PreflightInput(signed_probe(load_private_key(req.key), req.model, req.version), req.model, router,
                         previous_version)
    try:
        problems = await client.execute_workflow(
            PreflightWorkflow.run, inp, id=f"preflight-{req.model}-{req.version}-{uuid.uuid4().hex[:8]}",
            task_queue=CONTROL_QUEUE, execution_timeout=PREFLIGHT_TIMEOUT, result_type=list[str])
    except WorkflowFailureError as e:
        if isinstance(e.cause, TemporalTimeout):
            raise PublishError(f"no control worker answered on {CONTROL_QUEUE} within "
                               f"{PREFLIGHT_TIMEOUT.total_seconds():.0f} s: is it running? nothing published") from None
        raise PublishError(f"the pre-checks failed: {e.cause or e}; nothing published") from None
    if problems:
        raise PublishError("refused before uploading: " + "; ".join(problems))


async def publish_and_start(client: Client, req: PublishRequest, hosts: list[HostSpec], **rollout: object) -> dict:
    """Check, upload, sign, start (or attach to) the rollout. ``rollout`` takes RolloutInput's optional
    fields (router, previous_version, max_concurrent_loads, failure_budget, ...)."""
    origin = {"endpoint": req.origin.endpoint, "bucket": req.origin.bucket, "prefix": req.origin.prefix}
    # refuse bad input before uploading anything, every problem at once (the manifest is not signed
    # yet: a placeholder stands in; the host list's own reference is ours, so only its entries can be wrong)
    listed, fleet = inventory.encode(hosts)
    problems = host_problems(hosts, bool(rollout.get("router"))) + [
        p for p in RolloutInput(req.model, req.version, "", origin, [], manifest=ManifestRef("0" * 64, MARKER),
                                inventory=fleet, **rollout).problems() if not p.startswith("inventory.")]
    if problems:
        raise InvalidRolloutInput("nothing published: " + "; ".join(problems))
    check_label(req)
    await preflight(client, req, str(rollout.get("router") or ""), str(rollout.get("previous_version") or ""))
    pub = await upload(req)
    await _put_host_list(req, fleet.key, listed)
    # by reference: the workflow and every host activity carry (digest, key), never the documents
    inp = RolloutInput(req.model, req.version, "", origin, [], manifest=ManifestRef(pub.manifest.digest, MARKER),
                       inventory=fleet, **rollout)
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


async def _put_host_list(req: PublishRequest, key: str, raw: bytes) -> None:
    try:
        async with S3Origin(req.origin, req.access_key, req.secret_key) as o:
            await o.put_bytes(o.spec.key(key), raw)
    except (BotoCoreError, ClientError, OriginError) as e:
        raise PublishError(f"object storage at {req.origin.endpoint}: writing the host list {key}: {e}",
                           retryable=True) from None


def hosts_from_file(path: Path) -> list[HostSpec]:
    """The fleet inventory: a JSON list of {"id", "model_server", "rack"} objects."""
    try:
        raw = json.loads(path.read_text())
        return [HostSpec(**h) for h in raw]
    except (OSError, ValueError, TypeError) as e:
        raise PublishError(f"{path}: not a host list ({e}); expected JSON like "
                           '[{"id": "gpu-001", "model_server": "http://10.0.0.1:8100", "rack": "r1"}]') from None
