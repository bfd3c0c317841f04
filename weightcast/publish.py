"""`weightcast publish` (CI/CD, after training): sign a checkpoint's manifest, start its rollout, and
upload its bytes while the fleet starts. Safe to retry at every step:

- nothing is signed or uploaded until the pre-checks pass: the checkpoint's own version label matches
  the version being published, and the control worker (the one that will check the real manifest)
  trusts the signing key and can reach the router with its admin token (``PreflightWorkflow``);
- the files are hashed (in parallel, at the page cache's speed) and the signed manifest goes to
  ``<prefix>/.weightcast-manifest.json``. If one is already there for the same files and chunks, it is
  reused (and so is its version id); if it describes other bytes the version name is taken and
  publishing is refused (versions are immutable: publish a new version);
- the host list goes next to the manifest, named by its SHA-256; the rollout carries only that
  reference (a 10,000-host list inline would be the largest payload of its history);
- the rollout starts idempotently (``start_rollout``): a retried job attaches to the running rollout,
  and a finished one is reported, never started again;
- then the bytes: each chunk is hashed again from the buffer being uploaded and must match the signed
  manifest before its part leaves (weightcast/upload.py); ``.weightcast-complete.json`` is written
  last. Hosts read from the origin only files already complete, and check every chunk on arrival as
  always. A publish that fails here aborts its rollout: no host ever has all the bytes, so none loads.
  A publisher that dies here leaves the rollout waiting in distribution; publishing again finishes
  the upload and the rollout goes on.

``upload`` is the other order (the training hand-off): upload, reading each file once, then sign.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import TimeoutError as TemporalTimeout, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities import inventory
from peerd import manifest as mf
from peerd.origin import OriginError, OriginSpec, S3Origin
from peerd.signing import load_private_key
from serving import golden
from serving.checkpoint import SMOKE
from serving.hf_engine import is_hf_checkpoint
from weightcast.upload import Changed, Uploader, UploadConfig, plan
from weightcast.rollouts import InvalidRolloutInput, rollout_id, start_rollout
from workflows.preflight import PreflightWorkflow
from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, HostSpec, ManifestRef, PreflightInput, RolloutInput, host_problems

log = logging.getLogger("weightcast.publish")

MARKER = ".weightcast-manifest.json"       # the signed manifest: what a rollout references
COMPLETE = ".weightcast-complete.json"     # written last: every byte the manifest lists is stored
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
    upload: UploadConfig = field(default_factory=UploadConfig)   # part size and parts in flight


@dataclass
class Published:
    manifest: mf.Manifest
    signed: str
    uploaded: list[str] = field(default_factory=list)
    already_there: bool = False


async def upload(req: PublishRequest) -> Published:
    """Upload, then sign (the training hand-off: nothing starts before the last byte is stored). Each
    file is read once: its chunks are hashed from the buffers being uploaded, and the manifest is
    signed when the last digest is known."""
    key, serving = await _key_and_serving(req)
    return await _at_origin(req, lambda o: _upload_then_sign(o, req, key, serving))


async def _upload_then_sign(o: S3Origin, req: PublishRequest, key, serving: dict | None) -> Published:
    prior = await _prior(o, req, key)
    if prior is not None:
        staged = await _same_as_prior(req, prior, lambda: mf.build_from_directory(
            req.source, req.model, req.version, req.chunk_size, req.hash_algorithm, serving))
        if staged.complete:
            return Published(staged.manifest, staged.signed, [], already_there=True)
        return await _finish(o, req, staged)
    done = await Uploader(o, req.chunk_size, req.hash_algorithm, req.upload).run(plan(req.source, req.chunk_size))
    m = mf.assemble(req.model, req.version, req.chunk_size, [fe for fe, _ in done], [c for _, cs in done for c in cs],
                    algorithm=req.hash_algorithm, serving=serving)
    signed = mf.signed_bytes(m, key)
    await o.put_bytes(o.spec.key(MARKER), signed)
    await o.put_bytes(o.spec.key(COMPLETE), _complete_record(m))
    return Published(m, signed.decode(), [fe.path for fe, _ in done])


async def stage(req: PublishRequest) -> Staged:
    """Hash and sign before uploading (a publish that starts its rollout at once): the files are hashed
    in parallel at the page cache's speed, the signed manifest is stored at ``MARKER``, and the bytes
    follow (``finish_upload``). Hosts trust no byte before this manifest covers it; a host reading
    ahead of the upload finds the file missing and retries."""
    key, serving = await _key_and_serving(req)

    def build() -> mf.Manifest:
        return mf.build_from_directory(req.source, req.model, req.version, req.chunk_size, req.hash_algorithm, serving)

    async def at(o: S3Origin) -> Staged:
        prior = await _prior(o, req, key)
        if prior is not None:
            return await _same_as_prior(req, prior, build)
        m = await asyncio.to_thread(build)
        signed = mf.signed_bytes(m, key)
        await o.put_bytes(o.spec.key(MARKER), signed)
        return Staged(m, signed.decode(), complete=False)
    return await _at_origin(req, at)


async def finish_upload(req: PublishRequest, staged: Staged, progress: Callable[[int], None] | None = None) -> Published:
    """The bytes of a staged version, each chunk checked against its signed manifest before it leaves;
    ``COMPLETE`` last. ``progress(n)`` per part sent."""
    if staged.complete:
        return Published(staged.manifest, staged.signed, [], already_there=True)
    return await _at_origin(req, lambda o: _finish(o, req, staged, progress))


async def _finish(o: S3Origin, req: PublishRequest, staged: Staged, progress: Callable[[int], None] | None = None
                  ) -> Published:
    try:
        files = plan(req.source, req.chunk_size, staged.manifest)
        await Uploader(o, req.chunk_size, staged.manifest.hash_algorithm, req.upload, progress).run(files)
    except Changed as e:
        raise PublishError(f"{e}; version id {staged.manifest.digest[:12]} is signed for other bytes: publish "
                           "the changed checkpoint under a new version") from None
    await o.put_bytes(o.spec.key(COMPLETE), _complete_record(staged.manifest))
    return Published(staged.manifest, staged.signed, [f.rel for f in files])


@dataclass
class Staged:
    """A version's signed manifest at the origin; ``complete``: its bytes are all there too."""
    manifest: mf.Manifest
    signed: str
    complete: bool


async def _key_and_serving(req: PublishRequest):
    if not req.source.is_dir():
        raise PublishError(f"{req.source} is not a directory; give the checkpoint directory training wrote")
    key = load_private_key(req.key)
    serving = {"golden": await asyncio.to_thread(golden_prompts, req.source)} if is_hf_checkpoint(req.source) else None
    return key, serving


async def _at_origin(req: PublishRequest, work):
    where = f"s3://{req.origin.bucket}/{req.origin.prefix}"
    try:
        async with S3Origin(req.origin, req.access_key, req.secret_key, session=_s3_session()) as o:
            await o.ensure_bucket()
            return await work(o)
    except Changed as e:
        raise PublishError(f"{e}; nothing published") from None
    except (BotoCoreError, ClientError, OriginError) as e:
        raise PublishError(f"object storage at {req.origin.endpoint} ({where}): {e}; check --endpoint, --bucket "
                           "and the AWS_* credentials", retryable=True) from None


async def _prior(o: S3Origin, req: PublishRequest, key) -> Staged | None:
    """What an earlier publish of this prefix left: its signed manifest and whether it finished."""
    raw = await o.read_object(MARKER)
    if raw is None:
        return None
    where = f"s3://{req.origin.bucket}/{req.origin.prefix}"
    try:
        m = mf.load_signed(raw, [key.public_key()])
    except mf.ManifestError as e:
        raise PublishError(f"{where} already holds a manifest this key cannot verify ({e}); "
                           "versions are immutable: publish under a new version or prefix") from None
    done = await o.read_object(COMPLETE)
    complete = done is not None and _complete_id(done) == m.digest
    return Staged(m, raw.decode(), complete)


async def _same_as_prior(req: PublishRequest, prior: Staged, build) -> Staged:
    """The earlier publish of this name must have been of these very bytes (versions are immutable)."""
    m = await asyncio.to_thread(build)
    p = prior.manifest
    if (p.files, p.chunks, p.chunk_size) != (m.files, m.chunks, m.chunk_size):
        raise PublishError(f"{req.model}/{req.version} is already published at s3://{req.origin.bucket}/"
                           f"{req.origin.prefix} with different contents (version id {p.digest[:12]}); versions are "
                           "immutable: publish under a new version")
    return prior


@functools.cache
def _s3_session():
    """One botocore session for every client a publish opens: its S3 model loads once."""
    return get_session()


def _complete_record(m: mf.Manifest) -> bytes:
    return json.dumps({"version_id": m.digest, "bytes": m.total_size, "files": len(m.files)}).encode()


def _complete_id(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except ValueError:
        return ""
    return doc.get("version_id", "") if isinstance(doc, dict) else ""


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


async def publish_and_start(client: Client, req: PublishRequest, hosts: list[HostSpec],
                            progress: Callable[[str, dict], None] | None = None, **rollout: object) -> dict:
    """Check, hash, sign, start (or attach to) the rollout, then upload. ``rollout`` takes RolloutInput's
    optional fields (router, previous_version, max_concurrent_loads, failure_budget, ...).
    ``progress(event, facts)`` is called as it goes: ``signed`` (version id, bytes), ``rollout``
    (started, attached or already finished), ``uploading`` (bytes sent so far), ``published``."""
    say = progress or (lambda event, facts: None)
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
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    staged = await stage(req)
    say("signed", {"version_id": staged.manifest.digest, "bytes": staged.manifest.total_size,
                   "already_uploaded": staged.complete, "seconds": round(loop.time() - t0, 3)})
    await _put_host_list(req, fleet.key, listed)
    # by reference: the workflow and every host activity carry (digest, key), never the documents
    inp = RolloutInput(req.model, req.version, "", origin, [], manifest=ManifestRef(staged.manifest.digest, MARKER),
                       inventory=fleet, **rollout)
    wid = rollout_id(req.model, req.version)
    out = {"model": req.model, "version": req.version, "version_id": staged.manifest.digest, "workflow_id": wid,
           "bytes": staged.manifest.total_size}
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
    out["rollout_started_s"] = round(loop.time() - t0, 3)
    say("rollout", {"workflow_id": wid, "rollout": out["rollout"], "seconds": out["rollout_started_s"]})
    # the bytes follow while the fleet starts: hosts read from the origin only what is complete
    sent = [0]

    def uploading(n: int) -> None:
        sent[0] += n
        say("uploading", {"bytes_sent": sent[0], "bytes": staged.manifest.total_size})
    try:
        pub = await finish_upload(req, staged, uploading)
    except PublishError as e:
        if "previous_outcome" not in out:
            await _abort_rollout(client, wid, f"publishing failed: {e}")
        raise PublishError(f"{e}; the rollout {wid} was aborted: no host loads a version whose bytes are not all "
                           "published", e.retryable) from None
    out.update(uploaded_files=len(pub.uploaded), upload="skipped (already published)" if pub.already_there else "done",
               published_s=round(loop.time() - t0, 3))
    say("published", {"files": len(pub.uploaded), "seconds": out["published_s"]})
    return out


async def _abort_rollout(client: Client, wid: str, reason: str, attempts: int = 8) -> None:
    """The rollout this publish started cannot finish: abort it (hosts drop what they fetched). An
    update can fail with its workflow task (a busy or restarting worker): retried with back-off; one
    the workflow refuses (it already ended) is final."""
    for attempt in range(attempts):
        try:
            await client.get_workflow_handle(wid).execute_update(RolloutWorkflow.abort, reason)
            return
        except WorkflowUpdateFailedError as e:
            log.warning("%s refused the abort after a failed publish: %s", wid, e.cause or e)
            return
        except RPCError as e:
            if attempt == attempts - 1:
                log.warning("could not abort %s after a failed publish (%d tries): %s; abort it by hand "
                            "(weightcast rollout abort %s)", wid, attempts, e, wid)
                return
            await asyncio.sleep(min(0.5 * 2 ** attempt, 5.0))


async def _put_host_list(req: PublishRequest, key: str, raw: bytes) -> None:
    try:
        async with S3Origin(req.origin, req.access_key, req.secret_key, session=_s3_session()) as o:
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
