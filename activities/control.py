"""Control-plane activities: manifest checks and the router (traffic). Idempotent."""
from __future__ import annotations

from pathlib import Path

import aiohttp
from temporalio import activity
from temporalio.exceptions import ApplicationError

from peerd import manifest as mf
from lib.http_input import bearer_headers
from peerd.manifest_fetch import fetch_from_origin
from peerd.origin import OriginSpec, S3Origin, warm_session
from peerd.signing import load_public_key
from activities import inventory
from activities.canary import judge
from workflows.types import (AnalysisInput, AnalysisResult, FleetPlan, InventoryCheck, ManifestCheck, ManifestInfo,
                             PreflightInput, TrafficInput)


def _origin(d: dict) -> OriginSpec:
    return OriginSpec(**{k: v for k, v in d.items() if k in ("endpoint", "bucket", "prefix", "region")})


def _info(m: mf.Manifest) -> ManifestInfo:
    return ManifestInfo(m.digest, m.model, m.version, m.total_size, len(m.chunks))


class ControlActivities:
    def __init__(self, trusted_keys: list[Path], s3_credentials: tuple[str, str] | None = None,
                 admin_token: str = ""):
        self.trusted = [load_public_key(p) for p in trusted_keys]
        self.admin = bearer_headers(admin_token)
        self.s3_credentials = s3_credentials or (None, None)   # None: the AWS_* variables
        self._s3_session = None

    async def warm(self) -> None:
        """Load the S3 client's model now (about a CPU-second), not in a rollout's first manifest check."""
        self._s3_session = await warm_session()

    def _s3(self, spec: dict) -> S3Origin:
        return S3Origin(_origin(spec), *self.s3_credentials, session=self._s3_session)

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
        async with self._s3(inp.origin) as origin:
            try:
                m, _ = await fetch_from_origin(origin, inp.ref.key, inp.ref.version_id, self.trusted)
            except mf.ManifestError as e:
                raise ApplicationError(f"manifest refused: {e}", type="ManifestRefused", non_retryable=True) from None
        return _info(m)

    @activity.defn(name="check_inventory")
    async def check_inventory(self, inp: InventoryCheck) -> FleetPlan:
        """Fetch the host list the rollout names, check its digest and every entry; what the workflow keeps."""
        return inventory.plan(await self._hosts(inp.origin, inp.ref, inp.need_servers))

    async def _hosts(self, origin: dict, ref, need_servers: bool):
        async with self._s3(origin) as o:
            try:
                return await inventory.fetch(o, ref, need_servers)
            except inventory.InventoryError as e:
                raise ApplicationError(f"host list refused: {e}", type="InventoryRefused", non_retryable=True) from None

    @activity.defn(name="preflight")
    async def preflight(self, inp: PreflightInput) -> list[str]:
        """Problems that would fail a rollout, found before anything is uploaded: a signing key this
        worker does not trust, a router it cannot reach or that refuses its admin token, a previous
        version the router does not know."""
        problems = []
        try:
            mf.load_signed(inp.signed_probe.encode(), self.trusted)
        except mf.ManifestError as e:
            problems.append(f"the fleet does not trust the signing key ({e}); sign with a key whose public half "
                            "the control worker has as --trusted-key")
        if inp.router:
            url = f"{inp.router}/admin/models/{inp.model}"
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self.admin) as s:
                    async with s.get(url) as r:
                        body = await r.json(content_type=None)
                if r.status == 401:
                    problems.append(f"the router at {inp.router} refuses the control worker's admin token")
                elif r.status == 200 and inp.previous_version and inp.previous_version not in body.get("weights", {}):
                    problems.append(f"the router does not serve {inp.model} {inp.previous_version!r} (it has "
                                    f"{sorted(body.get('weights', {}))}): traffic could not return to it")
                elif r.status == 404 and inp.previous_version:
                    problems.append(f"the router has no model {inp.model!r}, so no previous version "
                                    f"{inp.previous_version!r} to return traffic to")
                elif r.status not in (200, 404):
                    problems.append(f"the router at {inp.router} answered {r.status} to {url}")
            except (aiohttp.ClientError, OSError, ValueError) as e:
                problems.append(f"the control worker cannot reach the router at {inp.router}: {e}")
        return problems

    @activity.defn(name="analyze_traffic")
    async def analyze_traffic(self, inp: AnalysisInput) -> AnalysisResult:
        """The router's per-version numbers over the last window, judged (activities/canary.py)."""
        url = f"{inp.router}/admin/models/{inp.model}/stats"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self.admin) as s:
            async with s.get(url, params={"since_s": str(min(600.0, inp.config.interval_s))}) as r:
                if r.status == 401:
                    raise ApplicationError("the router refuses the admin token", type="Unauthorized",
                                           non_retryable=True)
                r.raise_for_status()
                versions = (await r.json(content_type=None))["versions"]
        return judge(versions.get(inp.version), versions.get(inp.baseline) if inp.baseline else None, inp.config)

    @activity.defn(name="set_traffic")
    async def set_traffic(self, inp: TrafficInput) -> dict:
        """Register hosts and versions (idempotent PUT/POST), then set the weights."""
        base = f"{inp.router}/admin/models/{inp.model}"
        servers = dict(inp.hosts)
        if inp.inventory is not None:       # every listed host but those not ready
            skip = set(inp.exclude)
            servers = {h.id: h.model_server for h in await self._hosts(inp.origin, inp.inventory, True)
                       if h.id not in skip}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), headers=self.admin) as s:
            if servers:
                async with s.put(f"{base}/hosts", json=servers) as r:
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
