"""The publish worker's activities (queue ``weightcast-publish``): a training run's hand-off to a rollout.

Only this worker holds the manifest signing key (docs/trust.md): hosts train and export, this worker
reads the export from a volume it shares with them, uploads it, signs its manifest and returns the
reference the rollout carries. Both activities are idempotent: ``upload`` skips a prefix whose marker
already describes the same bytes and refuses one that describes other bytes (versions are immutable).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from peerd.origin import OriginSpec
from peerd.signing import load_private_key
from weightcast.publish import MARKER, PublishError, PublishRequest, check_label, signed_probe, upload
from workflows.training_types import PublishedExport, PublishExport

HEARTBEAT_S = 5.0


class PublishActivities:
    def __init__(self, key: Path, s3_credentials: tuple[str, str] | None = None):
        self.key_path = key
        self.key = load_private_key(key)        # a bad key fails the worker at start, not a run at its end
        self.access, self.secret = s3_credentials or (None, None)

    @activity.defn(name="sign_probe")
    async def sign_probe(self, inp: PublishExport) -> str:
        """A tiny manifest signed with the publishing key, for the control worker's preflight."""
        return signed_probe(self.key, inp.model, inp.version)

    @activity.defn(name="publish_export")
    async def publish_export(self, inp: PublishExport) -> PublishedExport:
        req = PublishRequest(Path(inp.source), inp.model, inp.version, self.key_path,
                             OriginSpec(inp.origin["endpoint"], inp.origin["bucket"], inp.origin.get("prefix", "")),
                             inp.chunk_size, access_key=self.access, secret_key=self.secret)
        try:
            check_label(req)
            work = asyncio.ensure_future(upload(req))
            try:
                while not work.done():      # hashing and uploading hundreds of GB takes a while: stay alive
                    activity.heartbeat({"source": inp.source})
                    await asyncio.wait([work], timeout=HEARTBEAT_S)
            finally:
                work.cancel()               # cancelled activity: stop uploading (a retry starts over)
            pub = work.result()
        except PublishError as e:
            raise ApplicationError(str(e), type="PublishFailed", non_retryable=not e.retryable) from None
        activity.logger.info("published %s/%s as %s (%s)", inp.model, inp.version, pub.manifest.digest[:12],
                             "already there" if pub.already_there else f"{len(pub.uploaded)} files uploaded")
        return PublishedExport(pub.manifest.digest, MARKER, pub.manifest.total_size,
                               len(pub.manifest.files), pub.already_there)
