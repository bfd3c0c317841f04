"""One version's download on this host: drives the swarm policy with real I/O.

The job is idempotent and resumable: it starts from the store's bitmap, copies chunks that an
earlier version already holds, and asks the policy for everything else.
"""
from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import aiohttp

from peerd.buffer_pool import BufferPool
from peerd.choice import origin_slots
from peerd.chunk_fetch import BadResponse, PeerStatus, WrongLength
from peerd.job_host import JobHost
from peerd.manifest import Manifest
from peerd.origin import OriginError, OriginMissing, OriginSpec, S3Origin
from peerd.policy import ORIGIN, Cancel, Request, SwarmPolicy
from peerd.store import ChunkDigestMismatch, DiskFullError, VersionStore
from peerd.wire import WireError, unpack_bits

log = logging.getLogger("peerd.job")


class PeerBusy(Exception):
    pass


class PeerMissing(Exception):
    pass


class FetchJob:
    def __init__(self, host: JobHost, vs: VersionStore, origin: OriginSpec | None, seeders: list[str],
                 adopt: bool = False):
        self.host = host
        self.adopt = adopt            # files were placed in the store by its host: verify them in place first
        self.vs = vs
        self.m: Manifest = vs.manifest
        self.origin_spec = origin
        self.seeders = seeders
        self.state = "fetching"
        self.error: dict | None = None
        self.started = time.time()
        self.finished: float | None = None
        self.last_progress = self.started        # wall time of the last verified chunk (stuck detection)
        self.bytes = {"peer": 0, "origin": 0, "local": 0}
        self.duplicate_bytes = 0                 # received for a chunk verified meanwhile (endgame's second source)
        self.refetched_bytes = 0                 # requested again after it was verified here (must stay 0)
        self.policy: SwarmPolicy | None = None
        cfg = host.config.policy
        # kept up to every request the policy may have in flight at once (peers, origin, endgame):
        # a bound below that peak would free buffers only to allocate (and zero) them again at the next
        self.buffers = BufferPool(max((c.size for c in self.m.chunks), default=0),
                                  keep=cfg.max_inflight + cfg.seeder_inflight + cfg.origin_catch_up
                                  + cfg.endgame_chunks * cfg.endgame_dups)
        self._tasks: dict[tuple[int, str], asyncio.Task] = {}
        # fetches the policy cancelled (it counts their chunks missing again) whose bytes may already be
        # in a commit: that commit tells the policy itself, in the step that sets the chunk's bit
        self._orphans: set[asyncio.Task] = set()
        self._commits: set[asyncio.Task] = set()      # chunks received, being verified and written
        self._wake = asyncio.Event()
        self._origin: S3Origin | None = None
        self.task: asyncio.Task | None = None
        self._fatal: Exception | None = None
        self._stop_reason = ""

    def stop(self, reason: str) -> None:
        """Stop fetching (pause or abort upstream); verified chunks and the bitmap stay, and submitting
        the version again resumes from them."""
        if self.task is not None and not self.task.done() and not self._stop_reason:
            self._stop_reason = reason
            self.task.cancel()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"job-{self.vs.vid[:12]}")

    async def _run(self) -> None:
        try:
            if self.origin_spec is not None:   # the S3 client takes a while to build: start it now
                self._origin = await S3Origin(self.origin_spec, session=self.host.s3_session).__aenter__()
            if self.adopt:
                await self._adopt_in_place()
            await self._copy_local()
            if not self.vs.complete:
                await self._swarm()
            await asyncio.to_thread(self.vs.write_verified)
            self.state, self.finished = "complete", time.time()
            log.info("version complete", extra={"vid": self.vs.vid, "bytes": self.bytes,
                                                "seconds": round(self.finished - self.started, 3)})
            self.host.announce_soon()
        except DiskFullError as e:
            self._fail("disk_full", str(e))
        except asyncio.CancelledError:
            await self._settle()     # before the state says stopped: its counts are then final
            if self._stop_reason:
                self.state, self.finished = "stopped", time.time()
                self.error = {"code": "stopped", "message": self._stop_reason}
                log.info("job stopped", extra={"vid": self.vs.vid, "reason": self._stop_reason})
            else:
                self._fail("cancelled", "job cancelled (daemon stopping or version removed)")
            raise
        except Exception as e:  # the job must end in a visible state, never vanish
            log.exception("job failed")
            self._fail("internal", f"{type(e).__name__}: {e}")
        finally:
            await self._settle()
            self.buffers.close()         # a finished job keeps no chunk buffers (64 MiB each on a fleet)
            if self._origin:
                await self._origin.__aexit__(None, None, None)

    async def _settle(self) -> None:
        """No fetch left running, and every chunk already received is written and counted. A chunk
        whose write had begun is finished, not dropped: its worker thread makes the bitmap byte durable
        either way, so the in-memory bitmap (and a stopped job's bytes_done) must count it too."""
        for t in list(self._tasks.values()):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))
        if self._commits:
            await asyncio.wait(list(self._commits))

    def _fail(self, code: str, message: str) -> None:
        self.state, self.finished = "failed", time.time()
        self.error = {"code": code, "message": message}
        self.host.metrics.job_failures.labels(code).inc()
        log.error("job failed", extra={"vid": self.vs.vid, "code": code, "error": message})

    async def _adopt_in_place(self) -> None:
        """Chunks whose bytes are already in the version's files (a training rank's own checkpoint
        shard, linked in by its host) count once they hash to the manifest's digest; the rest are fetched."""
        for c in self.m.chunks:
            if c.file in self.vs.preexisting and not self.vs.has(c.index) \
                    and await asyncio.to_thread(self.vs.adopt_chunk, c.index):
                self.vs.mark_verified(c.index)
                self.bytes["local"] += c.size
                self.host.metrics.chunks.labels("local").inc()

    async def _copy_local(self) -> None:
        """Delta rollout: chunks whose digest an earlier stored version holds are copied, not fetched."""
        local = self.host.store.local_chunks(exclude_vid=self.vs.vid)
        for c in self.m.chunks:
            loc = local.get((c.digest, c.size))
            if loc is None or self.vs.has(c.index):
                continue
            data = await asyncio.to_thread(_pread, loc.path, loc.offset, loc.size)
            try:
                await asyncio.to_thread(self.vs.write_chunk, c.index, data)
                self.vs.mark_verified(c.index)
            except ChunkDigestMismatch:
                log.warning("local copy of chunk %d did not verify; will fetch it", c.index)
                continue
            self.bytes["local"] += c.size
            self.host.metrics.chunks.labels("local").inc()

    # ---------------------------------------------------------------- the swarm loop
    async def _swarm(self) -> None:
        cfg = self.host.config
        members = self.host.membership
        rack_members = tuple(sorted([cfg.host_id] + [m.id for m in members.members.values() if m.rack == cfg.rack]))
        self.policy = SwarmPolicy(me=cfg.host_id, n_chunks=len(self.m.chunks), rack=cfg.rack, have=self.vs.bits,
                                  config=cfg.policy, seed=hash(cfg.host_id) & 0xFFFFFFFF,
                                  seeders=tuple(self.seeders), rack_members=rack_members,
                                  origin_slots=origin_slots([c.size for c in self.m.chunks]))
        loop = asyncio.get_running_loop()
        for m in members.members.values():
            if m.dead:
                self.policy.member_dead(m.id)
            elif self.vs.vid in m.versions:
                self.on_bitmap(m.id, m.rack, m.versions[self.vs.vid])
        next_tick = loop.time() + 1.0
        started = loop.time()
        while not self.policy.complete:
            if self._fatal:
                raise self._fatal
            now = loop.time()
            for r in self.policy.next_requests(now):
                if self.vs.bits[r.chunk]:
                    self.refetched_bytes += self.m.chunks[r.chunk].size
                    self.host.metrics.refetched_bytes.inc(self.m.chunks[r.chunk].size)
                self._tasks[(r.chunk, r.source)] = asyncio.create_task(self._fetch(r))
            if now >= next_tick:
                self.policy.tick(now)
                next_tick = now + 1.0
                self._expire_unknown_seeders(now - started)
            self._wake.clear()
            wake_at = self.policy.wake_at(now)
            timeout = 0.25 if wake_at is None else min(0.25, max(0.005, wake_at - now))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a wait that finished in the
            # same turn as a cancel and drops the cancel, and a dropped stop lets the download run on
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _expire_unknown_seeders(self, age: float) -> None:
        """A seeder no gossip has ever reached us from is as good as dead: its origin stripe moves
        to the living seeders instead of waiting forever."""
        if age < self.host.config.dead_after:
            return
        members = self.host.membership.members
        for sid in self.seeders:
            if sid != self.host.config.host_id and (sid not in members or members[sid].dead):
                self.policy.member_dead(sid)

    # ---------------------------------------------------------------- events from the daemon
    def on_bitmap(self, peer_id: str, rack: str, packed: str, load: float | None = None) -> None:
        if self.policy is None or self.state != "fetching":
            return
        if peer_id not in self.policy.peers and len(self.policy.peers) >= self.host.config.max_active_peers:
            return
        self.policy.peer_bitmap(peer_id, unpack_bits(packed, len(self.m.chunks)),
                                asyncio.get_running_loop().time(), rack=rack, load=load)
        self._wake.set()

    def on_have(self, peer_id: str, chunks, load: float | None) -> None:
        """HAVE-stream news: chunks ``peer_id`` verified since its last frame (peers not tracked yet
        are added by their full message), and its upload load."""
        if self.policy is None or self.state != "fetching":
            return
        if chunks and max(chunks) >= len(self.m.chunks):
            raise WireError(f"chunk {max(chunks)} is out of range: version {self.vs.vid[:12]}… has "
                            f"{len(self.m.chunks)} chunks")
        self.policy.peer_has(peer_id, chunks, asyncio.get_running_loop().time(), load=load)
        if chunks:
            self._wake.set()

    def on_quarantine(self, peer_id: str) -> None:
        if self.policy is not None:
            self._cancel(self.policy.quarantine(peer_id))

    def on_peer_dead(self, peer_id: str) -> None:
        if self.policy is not None:
            self._cancel(self.policy.peer_dead(peer_id))
            self._wake.set()

    def _cancel(self, cancels: list[Cancel]) -> None:
        for c in cancels:
            t = self._tasks.pop((c.chunk, c.source), None)
            if t is not None:
                self._orphans.add(t)
                t.cancel()

    # ---------------------------------------------------------------- one chunk
    async def _fetch(self, r: Request) -> None:
        c = self.m.chunks[r.chunk]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reason = label = commit = None
        buf = None
        me = asyncio.current_task()
        try:
            data = buf = self.buffers.take(c.size)
            if r.source == ORIGIN:
                await self._from_origin(c, buf)
            else:
                await self._from_peer(r.source, c, buf)
            # hashed and written in a worker thread (hashlib releases the GIL: chunks hash in parallel,
            # off the loop); the buffer goes back to the pool only once that thread is done with it
            buf = None
            commit = asyncio.create_task(self._commit(r, data, me, t0))
            self._commits.add(commit)
            commit.add_done_callback(self._commits.discard)
            await asyncio.shield(commit)         # a cancel from here on leaves the write to finish
        except asyncio.CancelledError:
            if commit is None:
                self._orphans.discard(me)
                self.policy.chunk_failed(r.chunk, r.source, "cancelled", loop.time())
            else:                                # the write goes on: the policy hears how it ends
                self._orphans.add(me)
                commit.add_done_callback(partial(self._committed_after_cancel, r, t0, me))
            raise
        except (ChunkDigestMismatch, WrongLength) as e:
            reason = "corrupt"
            if r.source == ORIGIN:
                log.error("origin bytes do not match the signed manifest: %s", e)
                reason, label = "error", "origin_corrupt"     # retried later; its own count for operators
            else:
                log.warning("quarantining peer that served a bad chunk",
                            extra={"peer": r.source, "chunk": r.chunk, "error": str(e)})
                self.host.note_quarantine(r.source, str(e))
        except PeerBusy:
            reason = "busy"
        except (PeerMissing, OriginMissing):
            reason = "missing"
        except DiskFullError as e:
            self._fatal = e      # the swarm loop raises it: the job fails as disk_full
            return
        except (aiohttp.ClientError, asyncio.TimeoutError, OriginError, OSError, BadResponse, PeerStatus) as e:
            reason = "error"
            log.info("chunk fetch failed", extra={"peer": r.source, "chunk": r.chunk, "error": str(e) or type(e).__name__})
        finally:
            if buf is not None:      # not handed on: the fetch returned, so its receive thread is done with it
                self.buffers.give(buf)
            self._tasks.pop((r.chunk, r.source), None)
            self._wake.set()
        now = loop.time()
        if reason is not None:
            self.host.metrics.failures.labels(label or reason).inc()
            self._cancel(self.policy.chunk_failed(r.chunk, r.source, reason, now))
            return
        self._cancel(self.policy.chunk_done(r.chunk, r.source, c.size, now - t0, now))

    def _committed_after_cancel(self, r: Request, t0: float, fetch: asyncio.Task, commit: asyncio.Task) -> None:
        """A chunk whose fetch was cancelled (a peer declared dead, a stop) while it was being written
        and whose commit did not tell the policy (it failed, or it ended before the cancel): verified,
        the policy counts it held, or it would ask for the chunk again."""
        if fetch not in self._orphans:       # told by the commit itself
            return
        self._orphans.discard(fetch)
        now = asyncio.get_running_loop().time()
        if commit.cancelled() or commit.exception() is not None:
            self.policy.chunk_failed(r.chunk, r.source, "cancelled", now)
        else:
            self._cancel(self.policy.chunk_done(r.chunk, r.source, self.m.chunks[r.chunk].size, now - t0, now))

    async def _commit(self, r: Request, data: memoryview, fetch: asyncio.Task, t0: float) -> None:
        """Verify and write a received chunk, then count it (its own task: a cancel does not drop it)."""
        c = self.m.chunks[r.chunk]
        await self.buffers.use_in_thread(data, partial(self.vs.write_chunk, r.chunk))
        src = "origin" if r.source == ORIGIN else "peer"
        self.host.metrics.bytes_in.labels(src).inc(c.size)          # received: a second copy too
        if fetch in self._orphans:           # cancelled by the policy, which counts the chunk missing: it
            self._orphans.discard(fetch)     # hears now, before its next request could ask for it again
            now = asyncio.get_running_loop().time()
            self._cancel(self.policy.chunk_done(r.chunk, r.source, c.size, now - t0, now))
        if self.vs.bits[r.chunk]:            # the loop thread alone sets bits: an earlier copy won
            self.duplicate_bytes += c.size
            self.host.metrics.duplicate_bytes.inc(c.size)
            return
        self.vs.mark_verified(r.chunk)       # on the loop thread: the only writer of the bitmap
        self.bytes[src] += c.size            # each chunk counted once, for the source that supplied it
        self.last_progress = time.time()
        self.host.metrics.chunks.labels(src).inc()
        self.host.metrics.progress.labels(self.vs.vid[:12]).set(self.vs.done_chunks / len(self.m.chunks))
        self.host.have_news()

    async def _from_origin(self, c, into: memoryview) -> None:
        if self.origin_spec is None:
            raise OriginError("no origin configured for this version")
        if self._origin is None:
            self._origin = await S3Origin(self.origin_spec, session=self.host.s3_session).__aenter__()

        async def paced(n: int) -> None:
            await self.host.origin_bucket.acquire(n)
            await self.host.download_bucket.acquire(n, priority=True)

        await self._origin.read_range(c.file, c.offset, into, on_piece=paced)

    async def _from_peer(self, peer_id: str, c, into: memoryview) -> None:
        """The chunk's bytes from a peer, received in place into ``into`` (peerd/chunk_fetch.py); a
        silent uploader (its host died mid-upload) is given up after stall_after, not dead_after."""
        member = self.host.membership.members.get(peer_id)
        if member is None:
            raise PeerMissing()
        try:
            await self.host.chunks.fetch(member.addr, f"/v1/versions/{self.vs.vid}/chunks/{c.index}", into)
        except PeerStatus as e:
            if e.status == 404:
                raise PeerMissing() from None
            if e.status == 503:
                raise PeerBusy() from None
            raise

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        now = asyncio.get_running_loop().time()
        done = self.vs.verified_bytes()
        return {"version_id": self.vs.vid, "model": self.m.model, "version": self.m.version,
                "state": self.state, "error": self.error,
                "chunks_total": len(self.m.chunks), "chunks_done": self.vs.done_chunks,
                "bytes_total": self.m.total_size, "bytes_done": done, "bytes_by_source": dict(self.bytes),
                "files_total": len(self.m.files), "files_ready": self.vs.files_ready(),
                "duplicate_bytes": self.duplicate_bytes, "refetched_bytes": self.refetched_bytes,
                "origin_reads": self.policy.origin_reads if self.policy else 0,
                "origin_reads_in_flight": self.policy.origin_active if self.policy else 0,
                "buffers_allocated": self.buffers.allocated,
                "started": self.started, "finished": self.finished, "last_progress": self.last_progress,
                "peers": self.policy.peer_summary(now) if self.policy else []}


def _pread(path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)
