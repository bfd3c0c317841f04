"""Control-plane activities: manifest checks and the router (traffic). Idempotent."""
from __future__ import annotations

from pathlib import Path

import aiohttp
from temporalio import activity
from temporalio.exceptions import ApplicationError

from peerd import manifest as mf
from peerd.http_input import bearer_headers
from peerd.manifest_fetch import fetch_from_origin
from peerd.origin import OriginSpec, S3Origin
from peerd.signing import load_public_key
from workflows.types import ManifestCheck, ManifestInfo, TrafficInput


def _info(m: mf.Manifest) -> ManifestInfo:
    return ManifestInfo(m.digest, m.model, m.version, m.total_size, len(m.chunks))


class ControlActivities:
    def __init__(self, trusted_keys: list[Path], s3_credentials: tuple[str, str] | None = None,
                 admin_token: str = ""):
        self.trusted = [load_public_key(p) for p in trusted_keys]
        self.admin = bearer_headers(admin_token)
        self.s3_credentials = s3_credentials or (None, None)   # None: the AWS_* variables

    @activity.defn(name="check_manifest")
    async def check_manifest(self, signed_manifest: str) -> ManifestInfo:
        try:
            m = mf.load_signed(signed_manifest.encode(), self.trusted)
        except mf.ManifestError as e:
            raise ApplicationError(f"manifest refused: {e}", type="ManifestRefused", non_retryable=True) from None
        return _info(m)

    @activity.defn(name="check_manifest_ref")
    async def check_manifest_ref(self, inp: ManifestCheck) -> ManifestInfo:
        """Fetch the signed manifest the rollout names and check its digest and signature."""
        spec = OriginSpec(**{k: v for k, v in inp.origin.items() if k in ("endpoint", "bucket", "prefix", "region")})
        async with S3Origin(spec, *self.s3_credentials) as origin:
            try:
                m, _ = await fetch_from_origin(origin, inp.ref.key, inp.ref.version_id, self.trusted)
            except mf.ManifestError as e:
                raise ApplicationError(f"manifest refused: {e}", type="ManifestRefused", non_retryable=True) from None
        return _info(m)

    @activity.defn(name="set_traffic")
    async def set_traffic(self, inp: TrafficInput) -> dict:
        """Register hosts and versions (idempotent PUT/POST), then set the weights."""
        base = f"{inp.router}/admin/models/{inp.model}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self.admin) as s:
            if inp.hosts:
                async with s.put(f"{base}/hosts", json=inp.hosts) as r:
                    r.raise_for_status()
            for v in inp.versions:
                async with s.post(f"{base}/versions", json={"version": v}) as r:
                    r.raise_for_status()
            async with s.put(f"{base}/weights", json={"weights": inp.weights}) as r:
                body = await r.json(content_type=None)
                if r.status == 409:   # not enough ready capacity yet: retry later, it may come
                    raise ApplicationError(f"router refused weights {inp.weights}: {body.get('error')}",
                                           type="CapacityNotReady")
                if r.status >= 400:
                    raise ApplicationError(f"router answered {r.status}: {body}", non_retryable=True)
                return body
