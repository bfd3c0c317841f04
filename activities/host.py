"""Host activities (task queue host-<id>): drive this host's peerd and model server. Idempotent:
a retry re-attaches to peerd's job, which resumes from its bitmap."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import aiohttp
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from peerd.client import PeerdClient, PeerdError
from lib.http_input import bearer_headers
from workflows.types import DiscardInput, DistributeInput, DistributeResult, LoadInput


def progress_details(host: str, st: dict) -> dict:
    """Compact heartbeat details: what `weightcast rollout status` shows per host (live, no history cost)."""
    peers = sorted((p for p in st.get("peers", []) if p["alive"]), key=lambda p: -p["rate_bps"])[:4]
    return {"host": host, "chunks_done": st["chunks_done"], "chunks_total": st["chunks_total"],
            "bytes_done": st["bytes_done"], "bytes_total": st["bytes_total"],
            "idle_s": round(time.time() - st.get("last_progress", time.time()), 1),
            "peers": [{"peer": p["peer"], "rate_bps": p["rate_bps"]} for p in peers]}


async def _heartbeating(aw, every: float = 1.0):
    """Await ``aw`` while heartbeating; a cancellation delivered by a heartbeat cancels it."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=every)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()


class ReadAhead:
    """Tells the model server which files peerd has verified whole, so it reads and hashes them ahead
    of the load (serving/prepare.py). Only ever a head start: a model server that cannot take it is
    logged, and the load reads everything itself."""

    def __init__(self, server: str, admin: dict, model: str, version: str, vid: str, host: str):
        self.server, self.admin, self.host = server, admin, host
        self.body = {"model": model, "model_version": version, "version_id": vid}
        self.told = 0
        self.off = False

    async def tell(self, files: int) -> None:
        if self.off or files <= self.told:
            return
        self.told = files
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                    s.post(f"{self.server}/v1/prepare", json={**self.body, "files": files}, headers=self.admin) as r:
                if r.status != 200:
                    self.off = True
                    activity.logger.info("model server on %s takes no read-ahead (%s): %s", self.host, r.status,
                                         (await r.text())[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            activity.logger.warning("could not tell the model server on %s to read ahead: %s", self.host, e)


class HostActivities:
    def __init__(self, host_id: str, peerd_addr: str, token: str, store: Path, model_server: str,
                 admin_token: str = ""):
        self.host_id, self.peerd_addr, self.token = host_id, peerd_addr, token
        self.store, self.model_server = Path(store), model_server
        # the model server's load/unload and the router's permits take the admin token
        self.admin = bearer_headers(admin_token)

    @activity.defn(name="distribute")
    async def distribute(self, inp: DistributeInput) -> DistributeResult:
        ref = dataclasses.asdict(inp.manifest) if inp.manifest is not None else None
        doc = json.loads(inp.signed_manifest) if ref is None else None
        t0 = time.monotonic()
        async with PeerdClient(self.peerd_addr, self.token) as c, self._reaching_peerd():
            try:
                st = await c.start_job(doc, inp.origin, inp.seeders, manifest_ref=ref)
            except PeerdError as e:
                # a refused manifest or a full disk will not get better by retrying
                raise ApplicationError(f"{self.host_id}: {e.message}", type=f"Peerd{e.status}",
                                       non_retryable=e.status in (400, 401, 422, 507)) from None
            vid = st["version_id"]
            ahead = ReadAhead(self.model_server, self.admin, st["model"], st["version"], vid, self.host_id)
            try:
                while True:
                    st = await self._job(c, vid)
                    activity.heartbeat(progress_details(self.host_id, st))
                    await ahead.tell(st.get("files_ready", 0))
                    if st["state"] == "complete":
                        break
                    if st["state"] in ("failed", "stopped"):
                        err = st["error"] or {}
                        raise ApplicationError(f"{self.host_id}: {err.get('code')}: {err.get('message')}",
                                               type=f"Job_{err.get('code')}",
                                               non_retryable=err.get("code") == "disk_full")
                    await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                # the rollout was paused or aborted: stop peerd's download now (its verified chunks stay
                # for a resume; an abort removes the version afterwards) and say what this host keeps
                held = await asyncio.shield(self._stop(c, vid))
                if activity.is_worker_shutdown() or held is None:
                    raise
                return DistributeResult(vid, st["bytes_total"], st["bytes_by_source"], time.monotonic() - t0,
                                        stopped=True, bytes_held=held)
        return DistributeResult(vid, st["bytes_total"], st["bytes_by_source"], time.monotonic() - t0)

    @contextlib.asynccontextmanager
    async def _reaching_peerd(self):
        """Peerd down (killed, restarting) is a short retryable failure that names it, not an aiohttp
        traceback: status shows this message as the reason the host is stuck."""
        try:
            yield
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            raise ApplicationError(f"{self.host_id}: peerd at {self.peerd_addr} unreachable ({e})",
                                   type="PeerdUnreachable") from None

    async def _job(self, c: PeerdClient, vid: str) -> dict:
        try:
            return await c.job(vid)
        except PeerdError as e:
            if e.status != 404:
                raise
            # the job is gone: removed by an abort's discard, or peerd restarted without it; a retry
            # starts it again from the bitmap. Expected, so no traceback in the worker's log.
            raise ApplicationError(f"{self.host_id}: peerd has no job for {vid[:12]} (removed, or peerd "
                                   "restarted); starting it again", type="JobGone",
                                   category=ApplicationErrorCategory.BENIGN) from None

    async def _stop(self, c: PeerdClient, vid: str) -> int | None:
        """Stop the download; the verified bytes it keeps (None when peerd could not be asked)."""
        try:
            st = await c.stop_job(vid, "the rollout was paused or aborted")
            activity.logger.info("stopped the download of %s on %s", vid[:12], self.host_id)
            return int(st["bytes_done"])
        except (PeerdError, aiohttp.ClientError, OSError) as e:
            activity.logger.warning("could not stop the download of %s on %s: %s", vid[:12], self.host_id, e)
            return None

    @activity.defn(name="discard_version")
    async def discard_version(self, inp: DiscardInput) -> dict:
        """After an abort: unload the version from the model server if it is there (it carries no
        traffic: the workflow moved traffic back first) and remove it from peerd's store. Idempotent."""
        out = {"host": self.host_id, "unloaded": False, "removed": False}
        async with PeerdClient(self.peerd_addr, self.token) as c:
            model = inp.model or await self._model_of(c, inp.version_id)
            if model:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                    out["unloaded"] = await self._unload(s, model, inp.version)
            try:
                await c.remove(inp.version_id)
                out["removed"] = True
            except PeerdError as e:
                if e.status != 404:                     # 404: not stored here (already removed, never fetched)
                    raise
        return out

    @staticmethod
    async def _model_of(c: PeerdClient, version_id: str) -> str:
        """The model a stored version belongs to (its signed manifest says), for inputs that name only
        the version; "" when it is not stored here."""
        return next((v["model"] for v in (await c.status()).get("stored", []) if v["version_id"] == version_id), "")

    async def _unload(self, s: aiohttp.ClientSession, model: str, version: str) -> bool:
        """Unload (model, version) from the model server; False when it was not loaded."""
        async with s.post(f"{self.model_server}/v1/unload", json={"model": model, "model_version": version},
                          headers=self.admin) as r:
            if r.status == 401:
                raise ApplicationError("the model server refused the admin token", type="Unauthorized",
                                       non_retryable=True)
            return r.status == 200

    async def _loaded(self, s: aiohttp.ClientSession) -> dict[tuple[str, str], dict]:
        """What the model server holds, by (model, version)."""
        async with s.get(f"{self.model_server}/v1/versions") as r:
            r.raise_for_status()
            return {(v["model"], v["version"]): v for v in (await r.json(content_type=None))["versions"]}

    @activity.defn(name="load_version")
    async def load_version(self, inp: LoadInput) -> dict:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            retired = await self._retire(s, inp)
            # a large checkpoint loads for minutes: heartbeat meanwhile, so an abort's cancellation
            # reaches this activity within a heartbeat (the discard that follows unloads the version,
            # and the model server drops a load that was unloaded while it ran)
            r, body = await _heartbeating(self._post_load(s, inp))
            pruned = await self._prune_or_log(s, inp) if r.status == 200 else []
        if r.status != 200:
            # fail closed: a version that does not verify, fit or pass its smoke test is not retried blindly
            raise ApplicationError(f"{self.host_id}: load of {inp.version} failed: {body.get('code')}: "
                                   f"{body.get('reason') or body.get('error')}", type="LoadFailed",
                                   non_retryable=r.status in (400, 401, 403, 404) or body.get("code") in (
                                       "altered", "unverified", "unverifiable", "wrong_version", "smoke_failed",
                                       "bad_checkpoint"))
        return {**body, "retired": retired, "pruned": pruned}

    async def _post_load(self, s: aiohttp.ClientSession, inp: LoadInput):
        async with s.post(f"{self.model_server}/v1/load", headers=self.admin,
                          json={"model": inp.model, "model_version": inp.version, "version_id": inp.version_id}) as r:
            return r, await r.json(content_type=None)

    async def _prune_or_log(self, s: aiohttp.ClientSession, inp: LoadInput) -> list[str]:
        """The load has succeeded: housekeeping that cannot run now (peerd down) must not undo it; the
        next rollout's load prunes again."""
        try:
            return await self._prune(s, inp)
        except (PeerdError, aiohttp.ClientError, OSError) as e:
            activity.logger.warning("could not prune %s's store on %s: %s", inp.model, self.host_id, e)
            return []

    async def _prune(self, s: aiohttp.ClientSession, inp: LoadInput) -> list[str]:
        """Storage retention: remove from peerd's store every version of this model that the rollout
        does not keep (the new one, the previous one, pinned ones), that the model server does not hold
        and that is not downloading. Without this each rollout adds a checkpoint to every disk."""
        if not inp.keep:
            return []
        loaded = set(await self._loaded(s))
        removed = []
        async with PeerdClient(self.peerd_addr, self.token) as c:
            st = await c.status()
            fetching = {j["version_id"] for j in st["jobs"] if j["state"] == "fetching"}
            for v in st.get("stored", []):
                if (v["model"] != inp.model or v["version"] in inp.keep or v["version"] in inp.pinned
                        or (v["model"], v["version"]) in loaded
                        or v["version_id"] in fetching):
                    continue
                try:
                    await c.remove(v["version_id"])
                    removed.append(v["version"])
                except PeerdError as e:
                    if e.status != 404:                 # 404: removed meanwhile
                        raise
        if removed:
            activity.logger.info("removed %s of %s from %s's store", removed, inp.model, self.host_id)
        return removed

    async def _retire(self, s: aiohttp.ClientSession, inp: LoadInput) -> list[str]:
        """Unload this model's versions older than the ones this rollout keeps (the new one and the one it
        replaces), so successive rollouts do not run out of slots or memory. Other models' versions are
        never touched: their traffic is theirs. With a router, only with its unload permit for that
        (model, version) (it refuses while the version still carries traffic on too few hosts)."""
        if not inp.keep:
            return []
        retired = []
        for (model, v), st in sorted((await self._loaded(s)).items()):
            if model != inp.model or v in inp.keep or st.get("state") != "ready":
                continue
            if inp.router:
                async with s.post(f"{inp.router}/admin/models/{model}/permits/unload", headers=self.admin,
                                  json={"host": self.host_id, "version": v}) as r:
                    answer = await r.json(content_type=None)
                    if r.status == 401:
                        raise ApplicationError(f"router refused the admin token: {answer.get('error')}",
                                               type="Unauthorized", non_retryable=True)
                    if r.status != 200:
                        activity.logger.info("router refused to retire %s %s on %s: %s", model, v, self.host_id,
                                             answer.get("reason") or answer.get("error"))
                        continue
            if await self._unload(s, model, v):
                retired.append(v)
        return retired
