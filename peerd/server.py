"""peerd's HTTP API (aiohttp). Every input is size-limited and schema-checked; errors are JSON 4xx."""
from __future__ import annotations

import asyncio
import logging
import re

from aiohttp import web

from peerd import have_stream
from lib.http_input import BadInput, bearer_ok, read_json
from peerd.manifest import ManifestError
from lib.metrics_http import metrics_handler
from peerd.origin import OriginError
from peerd.store import DiskFullError, StoreError
from peerd.wire import MAX_GOSSIP_BYTES, MAX_JOB_BYTES, WireError, check_gossip, check_job, check_vid, pack_bits

log = logging.getLogger("peerd.http")
UPLOAD_PIECE = 128 * 1024     # a paced upload sends pieces of about 4 ms of its rate, at least this
_INDEX = re.compile(r"^[0-9]{1,12}\Z")
_RANGE = re.compile(r"^bytes=([0-9]{1,15})-([0-9]{0,15})\Z")


def _error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def make_app(daemon, *middlewares) -> web.Application:
    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path.startswith("/v1/") and daemon.config.token and not bearer_ok(request, daemon.config.token):
            return _error(401, "missing or wrong cluster token (Authorization: Bearer <token>)")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400 and e.content_type != "application/json":
                return _error(e.status, e.reason)
            raise
        except WireError as e:
            return _error(400, str(e))
        except BadInput as e:
            return _error(e.status, str(e))

    app = web.Application(middlewares=[*middlewares, guard], client_max_size=MAX_JOB_BYTES)
    d = daemon

    async def healthz(_):
        return web.json_response({"ok": True, "host": d.config.host_id})

    async def submit_job(request):
        body = check_job(await read_json(request, MAX_JOB_BYTES))
        try:
            job = await d.submit(body)
        except ManifestError as e:
            return _error(422, f"manifest refused: {e}")
        except OriginError as e:
            return _error(502, str(e), code="manifest_unavailable")
        except DiskFullError as e:
            return _error(507, str(e), code="disk_full")
        except StoreError as e:
            return _error(422, f"cannot lay the version out on disk: {e}", code="bad_layout")
        return web.json_response(job.status(), status=202)

    def job_for(request):
        vid = check_vid(request.match_info["vid"])
        job = d.jobs.get(vid)
        if job is None:
            raise web.HTTPNotFound(reason=f"no job for version {vid[:12]}… on {d.config.host_id}; POST /v1/jobs first")
        return job

    async def job_status(request):
        return web.json_response(job_for(request).status())

    async def stop_job(request):
        """Stop a download (a paused or aborted rollout); the verified chunks stay. Idempotent."""
        job = job_for(request)
        reason = request.query.get("reason", "stopped by the control plane")[:200]
        job.stop(reason)
        if job.task is not None:
            await asyncio.wait([job.task], timeout=5)       # answer once it has really stopped
        return web.json_response(job.status())

    async def status(_):
        return web.json_response({
            "host": d.config.host_id, "addr": d.addr, "rack": d.config.rack,
            "jobs": [j.status() for j in d.jobs.values()],
            "stored_versions": sorted(d.store.versions),
            "stored": [{"version_id": vid, "model": vs.manifest.model, "version": vs.manifest.version,
                        "bytes": vs.manifest.total_size, "complete": vs.complete}
                       for vid, vs in sorted(d.store.versions.items())],
            "members": [{"id": m.id, "addr": m.addr, "rack": m.rack, "dead": m.dead}
                        for m in d.membership.members.values()],
            "quarantined": d.quarantined, "uploads_active": d.uploads_active})

    def version_store(request):
        vid = check_vid(request.match_info["vid"])
        vs = d.store.versions.get(vid)
        if vs is None:
            raise web.HTTPNotFound(reason=f"version {vid[:12]}… is not stored on {d.config.host_id}")
        return vs

    async def manifest(request):
        vs = version_store(request)
        return web.FileResponse(vs.root / "manifest.json", headers={"Content-Type": "application/json"})

    async def bitmap(request):
        vs = version_store(request)
        return web.json_response({"version_id": vs.vid, "chunks": len(vs.bits), "bits": pack_bits(vs.bits)})

    async def chunk(request):
        vs = version_store(request)
        raw_index = request.match_info["index"]
        if not _INDEX.match(raw_index):
            raise WireError(f"chunk index {raw_index[:32]!r} must be a decimal integer")
        index = int(raw_index)
        if not 0 <= index < len(vs.bits):
            return _error(400, f"chunk index {index} out of range [0, {len(vs.bits)})")
        if not vs.has(index):   # only verified chunks ever leave this host
            return _error(404, f"chunk {index} is not verified here yet")
        if (vs.fingerprints or vs.suspect) and not await asyncio.to_thread(vs.unchanged_or_rechecked, index):
            await d.corrupt_on_disk(vs, index)
            return _error(404, f"chunk {index} changed on disk after verification; not served")
        loc = vs.location(index)
        start, end = 0, loc.size - 1
        rng = request.headers.get("Range")
        if rng:
            mt = _RANGE.match(rng)
            if not mt:
                return _error(416, f"unsupported Range {rng!r}; use bytes=a-b")
            start = int(mt.group(1))
            end = min(int(mt.group(2)) if mt.group(2) else loc.size - 1, loc.size - 1)
            if start > end:
                return _error(416, f"Range {rng!r} is outside the chunk's {loc.size} bytes")
        if d.uploads_active >= d.config.max_uploads:
            d.metrics.busy.inc()
            return _error(503, "upload slots full; try another peer")
        count = end - start + 1
        d.uploads_active += 1
        resp = web.StreamResponse(status=206 if rng else 200, headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(count),
            **({"Content-Range": f"bytes {start}-{end}/{loc.size}"} if rng else {})})
        try:
            await resp.prepare(request)
            if d.config.fault_corrupt_uploads:
                await d.upload_bucket.acquire(count)
                data = bytearray(vs.read_verified(index)[start:end + 1])
                data[0] ^= 0xFF
                await resp.write(bytes(data))
            else:
                # sendfile in pieces, each paid for in the upload bucket first: concurrent uploads
                # share the link (as TCP flows would) and the kernel copies, Python does not
                loop = asyncio.get_running_loop()
                piece = d.upload_bucket.piece(UPLOAD_PIECE, count)   # unpaced: one sendfile a chunk
                with open(loc.path, "rb") as f:
                    sent = 0
                    while sent < count:
                        n = min(piece, count - sent)
                        await d.upload_bucket.acquire(n)
                        transport = request.transport   # None once the requester has gone
                        if transport is None or transport.is_closing():
                            raise ConnectionResetError("the requester closed the connection")
                        await loop.sendfile(transport, f, loc.offset + start + sent, n)
                        sent += n
            d.metrics.bytes_out.inc(count)
        except ConnectionError as e:
            # normal in a swarm: endgame duplicates are cancelled, requesters give up on slow peers
            d.metrics.uploads_aborted.inc()
            log.debug("upload abandoned by the requester", extra={"chunk": index, "error": str(e)})
        finally:
            d.uploads_active -= 1
        return resp

    async def gossip(request):
        msg = check_gossip(await read_json(request, MAX_GOSSIP_BYTES))
        d.absorb_gossip(msg)
        d.metrics.gossip.labels("received").inc()
        return web.json_response(d.gossip_message())

    async def have(request):
        return await have_stream.serve(d, request)

    async def remove(request):
        vs = version_store(request)
        job = d.jobs.pop(vs.vid, None)
        if job and job.task:
            job.task.cancel()
        d.store.remove_version(vs.vid)
        return web.json_response({"removed": vs.vid})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_handler(d.metrics.registry))
    app.router.add_post("/v1/jobs", submit_job)
    app.router.add_get("/v1/jobs/{vid}", job_status)
    app.router.add_delete("/v1/jobs/{vid}", stop_job)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/versions/{vid}/bitmap", bitmap)
    app.router.add_get("/v1/versions/{vid}/manifest", manifest)
    app.router.add_get("/v1/versions/{vid}/chunks/{index}", chunk)
    app.router.add_delete("/v1/versions/{vid}", remove)
    app.router.add_post("/v1/gossip", gossip)
    app.router.add_get(have_stream.PATH, have)
    return app
