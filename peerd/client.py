"""Client for a peerd's HTTP API, used by host activities, the CLI and the benchmarks."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from lib.http_input import bearer_headers


class PeerdError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"peerd answered {status}: {message}")
        self.status, self.message = status, message


class PeerdClient:
    def __init__(self, addr: str, token: str = "", session: aiohttp.ClientSession | None = None):
        self.addr = addr.rstrip("/")
        self.headers = bearer_headers(token)
        self._session = session
        self._own = session is None

    async def __aenter__(self):
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc):
        if self._own and self._session:
            await self._session.close()

    async def _json(self, method: str, path: str, **kw):
        async with self._session.request(method, self.addr + path, headers=self.headers, **kw) as r:
            body = await r.json(content_type=None)
            if r.status >= 400:
                raise PeerdError(r.status, body.get("error", str(body)) if isinstance(body, dict) else str(body))
            return body

    async def start_job(self, signed_manifest: dict | None, origin: dict | None = None, seeders: list[str] = (),
                        peers: list[dict] = (), manifest_ref: dict | None = None, pinned: bool = False,
                        adopt: bool = False) -> dict:
        """Start (or attach to) a version's download: the signed document inline, or ``manifest_ref``
        {version_id, key} for peerd to fetch from the origin (the way to go past a few MB). ``pinned``:
        an unsigned body this caller vouches for (or a version id it names, its manifest from a peer);
        ``adopt``: verify the files already placed in the store before fetching the rest."""
        body = {"origin": origin, "seeders": list(seeders), "peers": list(peers), "pinned": pinned, "adopt": adopt}
        body.update({"manifest_ref": manifest_ref} if manifest_ref is not None else {"manifest": signed_manifest})
        return await self._json("POST", "/v1/jobs", json=body)

    async def manifest(self, vid: str) -> bytes:
        async with self._session.get(f"{self.addr}/v1/versions/{vid}/manifest", headers=self.headers) as r:
            if r.status != 200:
                raise PeerdError(r.status, (await r.text())[:500])
            return await r.read()

    async def job(self, vid: str) -> dict:
        return await self._json("GET", f"/v1/jobs/{vid}")

    async def metric(self, name: str) -> float:
        """The sum of one Prometheus series (``name`` or ``name{labels}``) from ``GET /metrics``."""
        async with self._session.get(f"{self.addr}/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))

    async def stop_job(self, vid: str, reason: str = "") -> dict:
        """Stop fetching ``vid`` (verified chunks stay; ``start_job`` again resumes)."""
        return await self._json("DELETE", f"/v1/jobs/{vid}", params={"reason": reason} if reason else None)

    async def status(self) -> dict:
        return await self._json("GET", "/v1/status")

    async def bitmap(self, vid: str) -> dict:
        return await self._json("GET", f"/v1/versions/{vid}/bitmap")

    async def remove(self, vid: str) -> dict:
        return await self._json("DELETE", f"/v1/versions/{vid}")

    async def wait(self, vid: str, timeout: float, poll: float = 0.1, on_progress=None) -> dict:
        """Poll until the job is complete or failed; returns its last status."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.job(vid)
            if on_progress:
                on_progress(st)
            if st["state"] in ("complete", "failed"):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.addr}: version {vid[:12]} not complete after {timeout}s "
                                   f"({st['chunks_done']}/{st['chunks_total']} chunks)")
            await asyncio.sleep(poll)
