"""The peerd process: its state (store, membership, jobs) and its background loops (gossip, sweep)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from peerd import manifest as mf
from peerd.config import PeerdConfig
from lib.conn_guard import ConnectionGuard
from peerd import have_stream
from peerd.chunk_fetch import ChunkFetcher
from lib.http_input import bearer_headers
from peerd.job import FetchJob
from peerd.manifest_fetch import fetch_from_origin, pinned_document, verify_named, verify_pinned
from peerd.membership import Membership
from peerd.metrics import PeerdMetrics
from peerd.origin import OriginError, OriginSpec, S3Origin, warm_session
from peerd.ratelimit import TokenBucket
from peerd.signing import load_public_key
from peerd.store import ChunkStore, StoreError
from peerd.wire import WireError, check_gossip, pack_bits

log = logging.getLogger("peerd")


class Daemon:
    def __init__(self, config: PeerdConfig):
        self.config = config
        self.metrics = PeerdMetrics()
        self.store = ChunkStore(config.store, cpu_meter=lambda stage, s: self.metrics.store_cpu.labels(stage).inc(s))
        self.trusted = [load_public_key(p) for p in config.trusted_keys]
        self.jobs: dict[str, FetchJob] = {}
        self.quarantined: dict[str, str] = {}
        self.upload_bucket = TokenBucket(config.upload_rate)
        self.download_bucket = TokenBucket(config.download_rate)
        # a deeper burst on the origin link: the gap between one range read ending and the next
        # starting (S3 latency, fsync) is made up instead of lost; the long-run rate is unchanged
        self.origin_bucket = TokenBucket(config.origin_rate, burst=config.origin_rate * 0.5 if config.origin_rate else None)
        self.uploads_active = 0
        self.addr = config.advertise or ""
        self.membership: Membership | None = None
        self.http: aiohttp.ClientSession | None = None
        # chunk bytes travel on their own lean connections, received in place (peerd/chunk_fetch.py)
        self.chunks = ChunkFetcher(bearer_headers(config.token), self.download_bucket, config.stall_after)
        self.have_links = have_stream.HaveLinks(self)
        self._loops: list[asyncio.Task] = []
        self._opening = asyncio.Lock()               # submits lay out versions one at a time
        self._wake = asyncio.Event()                 # something to push: a finished chunk, a new or finished job
        self._full_due = False                       # ... that every member should hear (a job started or finished)
        self.runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        from peerd.server import make_app
        self.guard = ConnectionGuard(self.config.header_timeout, self.config.max_connections,
                                     self.config.body_timeout)
        self.runner = web.AppRunner(make_app(self, self.guard.middleware), access_log=None,
                                    keepalive_timeout=self.config.keepalive_timeout)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.listen_host, self.config.port)
        await site.start()
        port = self.runner.addresses[0][1]
        self.addr = self.config.advertise or f"http://{self.config.listen_host}:{port}"
        me = {"id": self.config.host_id, "addr": self.addr, "rack": self.config.rack}
        self.membership = Membership(me, self.config.dead_after, max_members=self.config.max_members)
        for p in self.config.seed_peers:
            self.membership.learn(p)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=3, sock_read=15),
                                          connector=aiohttp.TCPConnector(limit=256))
        self.s3_session = await warm_session()
        self._resume_stored()
        self._loops = [asyncio.create_task(self._gossip_loop(), name="gossip"),
                       asyncio.create_task(self._sweep_loop(), name="sweep"),
                       asyncio.create_task(self.guard.run(self.runner.server), name="connection-guard")]
        if self.config.ready_file:
            self.config.ready_file.write_text(json.dumps({"addr": self.addr, "id": self.config.host_id}))
        log.info("peerd up", extra={"addr": self.addr, "host": self.config.host_id, "store": str(self.config.store)})

    async def stop(self) -> None:
        for t in self._loops + [j.task for j in self.jobs.values() if j.task]:
            t.cancel()
        await asyncio.gather(*self._loops, *[j.task for j in self.jobs.values() if j.task], return_exceptions=True)
        await self.have_links.close()       # both sides: open websockets would hold the shutdown
        self.chunks.close()
        if self.http:
            await self.http.close()
        if self.runner:
            await self.runner.cleanup()
        for vs in self.store.versions.values():
            vs.close()

    def _resume_stored(self) -> None:
        """After a restart every stored version is served again; unfinished ones resume when re-submitted."""
        for vid in self.store.stored_version_ids():
            raw = (self.store.root / "versions" / vid / "manifest.json").read_bytes()
            try:
                doc = json.loads(raw)
                # a pinned version (a checkpoint) was vouched for when it was submitted; this disk is ours
                m = mf.parse_body(doc["manifest"]) if doc.get("pinned") is True else mf.load_signed(raw, self.trusted)
                vs = self.store.open_version(m, raw)
                if vs.complete:
                    vs.load_fingerprints()
            except (mf.ManifestError, OSError, StoreError, ValueError, KeyError, AttributeError) as e:
                log.warning("not serving stored version %s: %s", vid[:12], e)

    # ---------------------------------------------------------------- jobs
    async def submit(self, body: dict) -> FetchJob:
        """Start (or attach to) the download of a signed manifest, given inline or by reference.
        Idempotent per version."""
        origin = OriginSpec(**{k: v for k, v in body["origin"].items() if k in ("endpoint", "bucket", "prefix", "region")}) \
            if body["origin"] else None
        ref = body.get("manifest_ref")
        if ref is not None:
            job = self.jobs.get(ref["version_id"])
            if job is not None and job.state not in ("failed", "stopped"):
                return job
            m, raw = await self._fetch_manifest(ref, origin, pinned=body["pinned"])
        elif body["pinned"]:        # the caller (cluster token) vouches for an unsigned body: docs/trust.md
            m = await asyncio.to_thread(mf.parse_body, body["manifest"].get("manifest"))
            raw = pinned_document(body["manifest"]["manifest"])
        else:
            m = await asyncio.to_thread(mf.verify_signed, body["manifest"], self.trusted)   # already parsed
            raw = json.dumps(body["manifest"]).encode()                                    # kept as received
        job = self.jobs.get(m.digest)
        if job is not None and job.state not in ("failed", "stopped"):
            return job
        for p in body["peers"]:
            self.membership.learn(p)
        async with self._opening:        # one version laid out at a time: a second submit waits, then attaches
            job = self.jobs.get(m.digest)
            if job is not None and job.state not in ("failed", "stopped"):
                return job
            vs = self.store.versions.get(m.digest)
            if vs is None:               # pre-allocation off the loop: gossip and uploads go on meanwhile
                vs = self.store.add_version(await asyncio.to_thread(
                    self.store.prepare_version, m, raw, self.config.reserve_bytes))
            job = FetchJob(self, vs, origin, body["seeders"], adopt=body["adopt"])
            self.jobs[m.digest] = job
        job.start()
        self.announce_soon()
        return job

    async def _fetch_manifest(self, ref: dict, origin: OriginSpec | None, pinned: bool = False) -> tuple[mf.Manifest, bytes]:
        """From the origin; when it cannot be read, from a live peer that holds the version (the
        digest and signature make any source as good as the origin; for a pinned version, the digest)."""
        vid, key = ref["version_id"], ref["key"]
        stored = self.store.versions.get(vid)
        if stored is not None:
            return stored.manifest, (stored.root / "manifest.json").read_bytes()
        origin_error: Exception = OriginError("no origin given")
        if origin is not None and key:
            try:
                async with S3Origin(origin, session=self.s3_session) as o:
                    return await fetch_from_origin(o, key, vid, self.trusted)
            except OriginError as e:
                origin_error = e
        for m in [m for m in self.membership.live() if vid in m.versions][:4]:
            try:
                async with self.http.get(f"{m.addr}/v1/versions/{vid}/manifest", headers=self.auth_headers(),
                                         timeout=aiohttp.ClientTimeout(total=60)) as r:
                    if r.status != 200:
                        continue
                    raw = await r.read()
                if pinned:
                    return await verify_pinned(raw, vid, f"peer {m.id}"), raw
                return await verify_named(raw, vid, self.trusted, f"peer {m.id}"), raw
            except (aiohttp.ClientError, asyncio.TimeoutError, mf.ManifestError) as e:
                log.info("manifest from peer failed", extra={"peer": m.id, "error": str(e)})
        raise OriginError(f"cannot fetch manifest {vid[:12]}… from the origin ({origin_error}) nor from a peer")

    async def corrupt_on_disk(self, vs, index: int) -> None:
        """A verified chunk no longer matches the manifest (the file changed under peerd): stop serving it,
        withdraw the version's hand-off, and fail its job so the next submit fetches the chunk again."""
        vs.unmark_verified(index)                          # at once, on this thread: nothing serves it now
        await asyncio.to_thread(vs.forget_durably, index)
        self.metrics.corrupt_on_disk.inc()
        job = self.jobs.get(vs.vid)
        if job is not None and job.state == "complete":
            job.state, job.error = "failed", {"code": "corrupt_on_disk",
                                              "message": f"chunk {index} changed on disk after verification"}
        log.error("verified chunk changed on disk; no longer served, fetch it again",
                  extra={"vid": vs.vid, "chunk": index, "file": vs.manifest.chunks[index].file})

    def note_quarantine(self, peer_id: str, why: str) -> None:
        self.quarantined[peer_id] = why
        self.metrics.quarantined.set(len(self.quarantined))
        for j in self.jobs.values():
            j.on_quarantine(peer_id)

    def auth_headers(self) -> dict:
        return bearer_headers(self.config.token)

    # ---------------------------------------------------------------- gossip
    def upload_load(self) -> float:
        # the share of upload slots in use, so that peers spread their requests (docs/peerd.md)
        return round(self.uploads_active / max(self.config.max_uploads, 1), 3)

    def gossip_message(self, hearsay: bool = True) -> dict:
        return {"from": self.membership.me,
                "versions": {vid: pack_bits(vs.bits) for vid, vs in self.store.versions.items()},
                "peers": self.membership.sample_peers(8) if hearsay else [],
                "load": self.upload_load()}

    def absorb_gossip(self, msg: dict) -> None:
        member, _ = self.membership.heard_from(msg["from"], msg["versions"])
        for p in msg["peers"]:
            self.membership.learn(p)
        if member is None:
            log.warning("membership full; ignoring gossip from a new peer",
                        extra={"peer": msg["from"]["id"], "max_members": self.config.max_members})
            return
        if member.id in self.quarantined:
            return
        for vid, packed in msg["versions"].items():
            job = self.jobs.get(vid)
            if job is not None:
                try:
                    job.on_bitmap(member.id, member.rack, packed, msg["load"])
                except WireError as e:
                    log.warning("bad bitmap from %s: %s", member.id, e)

    def absorb_have(self, peer_id: str, msg: dict) -> None:
        """News from a HAVE stream: chunks ``peer_id`` verified since its last frame, and its load."""
        if not self.membership.touch(peer_id) or peer_id in self.quarantined:
            return                 # unknown or believed dead: its next full message brings it back
        for vid, job in self.jobs.items():
            job.on_have(peer_id, msg["have"].get(vid, ()), msg["load"])

    def announce_soon(self) -> None:
        """A job started or finished: a full gossip round now."""
        self._full_due = True
        self._wake.set()

    def have_news(self) -> None:
        """A chunk was verified and stored: push it to the active swarm within ``have_interval``
        (every hop of every chunk waits for this push; at 0.1 s batches the simulator lost 2-3 % of
        the fleet's download rate to it)."""
        self._wake.set()

    async def gossip_over_http(self, member, body: bytes) -> None:
        try:
            async with self.http.post(f"{member.addr}/v1/gossip", data=body,
                                      headers={**self.auth_headers(), "Content-Type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=3)) as r:
                if r.status != 200:
                    log.info("gossip refused", extra={"peer": member.id, "status": r.status})
                    return
                self.metrics.gossip.labels("sent").inc()
                self.absorb_gossip(check_gossip(await r.json()))
        except (aiohttp.ClientError, asyncio.TimeoutError, WireError, ValueError) as e:
            log.debug("gossip to %s failed: %s", member.id, e)

    async def _gossip_loop(self) -> None:
        cfg = self.config
        next_full = 0.0
        while True:
            now = time.monotonic()
            fetching = any(j.state == "fetching" for j in self.jobs.values())
            active, seeders = set(), set()
            for j in self.jobs.values():
                if j.policy is not None and j.state == "fetching":
                    active |= {p for p, s in j.policy.peers.items() if s.alive}
                if j.state == "fetching" and cfg.host_id in j.seeders:
                    seeders |= set(j.seeders) - {cfg.host_id}
            # while downloading, push bitmaps to the active swarm often (HAVE); otherwise gossip slowly
            full = now >= next_full or self._full_due
            if full:
                targets = self.membership.gossip_targets(cfg.gossip_fanout, active if fetching else set(), seeders)
                next_full = now + cfg.gossip_interval
            else:
                targets = [self.membership.members[i] for i in active if i in self.membership.members]
            self._full_due = False
            self._wake.clear()
            if targets:
                await asyncio.gather(*self._exchanges(targets, active, full))
            if full:
                self.have_links.close_idle(now)
            # pushes at most every have_interval, as soon as there is news; without news, every
            # have_refresh (upload load, liveness) while the swarm is busy, else every gossip_interval
            interval = cfg.have_refresh if (fetching or any(self._serving_others())) else cfg.gossip_interval
            gap = min(cfg.have_interval, interval)
            await asyncio.sleep(gap)
            try:
                async with asyncio.timeout(interval - gap):     # wait_for could drop a stop's cancel (peerd/job.py)
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _exchanges(self, targets, active: set[str], full: bool) -> list:
        """One round's exchanges: the active swarm's over HAVE links (news, or a full message on full
        rounds and new links), the random gossip targets' over HTTP. The full body is packed once a
        round, and every link that carries it is marked told in the same step (no await between)."""
        body = None
        out = []
        for m in targets:
            link = self.have_links.get(m) if self.config.have_stream and m.id in active else None
            if link is not None and not (full or link.fresh):
                out.append(self.have_links.exchange(link, have_stream.news_frame(self, link.cursor), full=False))
                continue
            if body is None:          # hearsay rides on full rounds only
                body = json.dumps(self.gossip_message(hearsay=full))
            if link is None:
                out.append(self.gossip_over_http(m, body.encode()))
            else:
                link.cursor.told_all(self.store)
                out.append(self.have_links.exchange(link, body, full=True))
        return out

    def _serving_others(self):
        return (j for j in self.jobs.values() if j.state == "complete" and time.time() - (j.finished or 0) < 30)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.dead_after / 4))
            for m in self.membership.sweep():
                log.info("peer declared dead", extra={"peer": m.id})
                for j in self.jobs.values():
                    j.on_peer_dead(m.id)
            self.metrics.peers_alive.set(len(self.membership.live()))
            self.chunks.close_idle()
