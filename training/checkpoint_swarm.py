"""Node-local checkpoints replicated through peerd's swarm, from the host worker's ``train_rank`` activity.

With ``--checkpoint-dir '/nvme/ckpt/{host}'`` every rank saves to its own host's disk. Once the ranks
have merged their digests (``merged.json``, training/checkpoint.py), each host turns the checkpoint
into a peerd version: its manifest is built from the merged digests (the same bytes on every host, so
the same version id), the files this host's rank wrote are linked into peerd's store and verified in
place (``adopt``), and the rest arrive from the other hosts' peerds, rarest chunk first, every host
uploading. When the version is whole, its files are linked into the step directory and
``complete.json`` is written: only then does this host count the checkpoint as complete. A
replacement host (a migrated rank) or a restarted one finds the newest checkpoint that a live peer
holds whole and fetches it the same way before its rank starts: from its peers, not from object storage.

Trust: the version is *pinned* (docs/trust.md): unsigned, vouched for by the host that submits it
(peerd's cluster token) or named by its id; every chunk is still checked against the manifest.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import aiohttp

from peerd import manifest as mf
from peerd.client import PeerdClient, PeerdError
from lib.http_input import bearer_headers
from lib.atomic import write_atomic
from training.checkpoint_files import MARK, MERGED, step_of

log = logging.getLogger("weightcast.training.checkpoint_swarm")

CREATED_AT = "1970-01-01T00:00:00Z"     # content-addressed: every host must build the same manifest


def run_model(run: str) -> str:
    """The peerd model name of a run's checkpoints."""
    return "train-" + re.sub(r"[^A-Za-z0-9._-]", "-", run)[:100]


def checkpoint_manifest(run: str, step_path: Path, mark_raw: bytes) -> mf.Manifest:
    """The checkpoint as a peerd version: every file the merged digests list, then the mark itself."""
    mark = json.loads(mark_raw)
    size_of_chunk = mark["chunk_size"]
    files, chunks = [], []
    for name, (size, digest, chunk_digests) in sorted(mark["files"].items()):
        files.append(mf.FileEntry(name, size, digest))
        for i, d in enumerate(chunk_digests):
            off = i * size_of_chunk
            chunks.append(mf.Chunk(len(chunks), name, off, min(size_of_chunk, size - off), d))
    hasher = mf.ChunkHasher(MARK, size_of_chunk, len(chunks))
    hasher.update(mark_raw)
    entry, mark_chunks = hasher.finish()
    return mf.assemble(run_model(run), step_path.name, size_of_chunk, files + [entry], chunks + mark_chunks,
                       created_at=CREATED_AT)


def _link(src: Path, dst: Path) -> None:
    """A hard link (the checkpoint is on disk once for training and for peerd); a copy across file systems."""
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copyfile(src, dst)


class CheckpointSwarm:
    def __init__(self, run: str, root: Path, peerd: str, token: str, store: Path, stall_s: float = 60.0):
        self.run, self.root, self.peerd, self.token, self.store = run, root, peerd, token, store
        # a replication that verifies nothing new for this long has lost the peers holding what it lacks
        self.stall_s = stall_s
        self.replicated: int | None = None          # the newest step whole on this host
        self.seeded: dict[str, mf.Manifest] = {}    # step directory name -> its version, submitted to peerd
        self._task: asyncio.Task | None = None

    # ---------------------------------------------------------------- while training
    def replicate_soon(self) -> None:
        """Start one replication pass unless one is running (called every heartbeat)."""
        if self._task is not None and not self._task.done():
            return
        if self._task is not None and self._task.exception() is not None:
            log.warning("checkpoint replication pass failed (%s); the next pass retries", self._task.exception())
        self._task = asyncio.ensure_future(self._pass())

    async def _pass(self) -> list[tuple[Path, dict]]:
        """Seed every merged checkpoint at once (every host must offer its files for the same steps, or
        a step one host skipped could never complete elsewhere), and lay out those whose versions are
        whole. Returns the steps still replicating with their job status."""
        merged = sorted(p for p in self.root.glob("step-*") if (p / MERGED).is_file() and not (p / MARK).is_file())
        pending = []
        async with PeerdClient(self.peerd, self.token) as c:
            for p in merged:
                if p.name not in self.seeded:
                    self.seeded[p.name] = await self.offer(c, p)
            for p in merged:
                m = self.seeded[p.name]
                st = await c.job(m.digest)
                if st["state"] == "complete":
                    self._materialize(p, self.store / "versions" / m.digest / "model", m)
                    self.replicated = max(self.replicated or 0, step_of(p))
                elif st["state"] in ("failed", "stopped"):
                    log.warning("checkpoint %s replication %s (%s); submitting it again", p.name, st["state"],
                                st.get("error"), extra={"step": step_of(p), "version_id": m.digest})
                    del self.seeded[p.name]
                else:
                    pending.append((p, st))
            await self._forget_older(c)
        return pending

    async def finish(self) -> None:
        """The final checkpoint whole on this host before the rank's activity reports success."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        while True:
            pending = await self._pass()
            if not pending:
                return
            newest, st = pending[-1]
            self._raise_if_stalled(newest.name, st)
            await asyncio.sleep(0.1)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def offer(self, c: PeerdClient, step_path: Path) -> mf.Manifest:
        """Offer this host's files of a merged checkpoint and start fetching the rest."""
        mark_raw = (step_path / MERGED).read_bytes()
        m = checkpoint_manifest(self.run, step_path, mark_raw)
        vdir = self.store / "versions" / m.digest / "model"
        vdir.mkdir(parents=True, exist_ok=True)
        for f in m.files:
            here = step_path / f.path
            if f.path == MARK:
                continue
            if here.is_file() and here.stat().st_size == f.size:
                _link(here, vdir / f.path)          # this rank's own file: verified in place, never sent
            else:
                # the others': one inode, filled by peerd, already linked here. Linking after the version
                # completes would change the files' ctime, and peerd would re-hash every chunk it serves
                (vdir / f.path).touch()
                _link(vdir / f.path, here)
        if not (vdir / MARK).exists():
            write_atomic(vdir / MARK, mark_raw)
        await c.start_job({"manifest": m.body()}, pinned=True, adopt=True)
        return m

    # ---------------------------------------------------------------- before a rank starts
    async def restore_newest(self) -> dict | None:
        """When a live peer holds a newer whole checkpoint than this host, fetch it through the swarm and
        lay it out here. This host's own peerd counts too: a step it replicated whole just before the
        rank's activity ended was never laid out (its mark not written), and is laid out now. Returns
        what was fetched ({step, version_id, bytes_from_peers, bytes_from_origin}; None: this host is
        as new as any peer)."""
        local = [step_of(p) for p in self.root.glob("step-*") if (p / MARK).is_file()] if self.root.is_dir() else []
        mine = max(local, default=-1)
        try:
            held = await self._held_by_peers()
        except (PeerdError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("this host's peerd at %s did not answer (%s): resuming from this host's own checkpoints",
                        self.peerd, e)
            return None
        for step, vid in held:
            if step <= mine:
                return None
            try:
                async with PeerdClient(self.peerd, self.token) as c:
                    await self._start_pinned(c, vid)
                    m = mf.parse_body(json.loads(await c.manifest(vid))["manifest"])
                    await self._wait(c, m)
                    got = (await c.job(vid))["bytes_by_source"]
            except (PeerdError, aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, mf.ManifestError) as e:
                log.warning("checkpoint step-%08d not fetched from peers (%s); trying an older one", step, e,
                            extra={"step": step, "version_id": vid})
                continue
            path = self.root / f"step-{step:08d}"
            path.mkdir(parents=True, exist_ok=True)
            self._materialize(path, self.store / "versions" / vid / "model", m)
            self.replicated = step
            # nothing received: this host's own peerd held it whole (replicated just before the rank ended)
            source = "fetched from peers through the swarm" if got["peer"] or got["origin"] else \
                "laid out from this host's own peerd"
            log.warning("checkpoint %s %s", path.name, source, extra={"step": step, "version_id": vid, "bytes": got})
            return {"step": step, "version_id": vid, "bytes_from_peers": got["peer"], "bytes_from_origin": got["origin"]}
        return None

    async def _held_by_peers(self) -> list[tuple[int, str]]:
        """(step, version id) of this run's checkpoints whole on this host's peerd or a live peer's,
        newest first."""
        model = run_model(self.run)
        found: dict[int, str] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with PeerdClient(self.peerd, self.token, session=s) as c:
                me = await c.status()

            async def stored(addr: str) -> list[dict]:
                try:
                    async with s.get(f"{addr}/v1/status", headers=bearer_headers(self.token)) as r:
                        return (await r.json())["stored"] if r.status == 200 else []
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                    log.info("peer %s not asked for checkpoints: %s", addr, e)
                    return []
            answers = [me["stored"], *await asyncio.gather(*(stored(m["addr"]) for m in me["members"]
                                                              if not m["dead"]))]
        for entry in [e for a in answers for e in a]:
            if entry["model"] == model and entry["complete"] and entry["version"].startswith("step-"):
                found[step_of(Path(entry["version"]))] = entry["version_id"]
        return sorted(found.items(), reverse=True)

    # ---------------------------------------------------------------- helpers
    def _raise_if_stalled(self, name: str, st: dict) -> None:
        if time.time() - st["last_progress"] > self.stall_s:
            raise TimeoutError(f"checkpoint {name}: nothing new verified for {self.stall_s:.0f} s "
                               f"({st['chunks_done']}/{st['chunks_total']} chunks): the hosts holding the "
                               "rest are gone")

    async def _start_pinned(self, c: PeerdClient, vid: str, within_s: float = 15.0) -> None:
        """A fresh peerd learns who holds what from gossip within a second or so: until then it cannot
        find the manifest (502), so ask again for a while."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            try:
                await c.start_job(None, manifest_ref={"version_id": vid}, pinned=True)
                return
            except PeerdError as e:
                if e.status != 502 or loop.time() > deadline:
                    raise
                await asyncio.sleep(0.25)

    async def _wait(self, c: PeerdClient, m: mf.Manifest) -> None:
        while True:
            st = await c.job(m.digest)
            if st["state"] == "complete":
                return
            if st["state"] in ("failed", "stopped"):
                raise RuntimeError(f"checkpoint {m.version} not replicated: {st.get('error')}")
            try:
                self._raise_if_stalled(m.version, st)
            except TimeoutError:
                await c.stop_job(m.digest, "no peer holds the rest")
                raise
            await asyncio.sleep(0.1)

    def _materialize(self, step_path: Path, vdir: Path, m: mf.Manifest) -> None:
        """The version's files linked into the step directory; the completion mark last."""
        if not step_path.is_dir():
            return                                  # pruned by the rank meanwhile
        for f in m.files:
            here = step_path / f.path
            if f.path == MARK:
                continue
            if here.exists() and here.stat().st_size != f.size:
                here.unlink()                       # a stale file under the same name: the verified one wins
            if not here.exists():
                _link(vdir / f.path, here)
        write_atomic(step_path / MARK, (vdir / MARK).read_bytes())

    async def _forget_older(self, c: PeerdClient) -> None:
        """peerd keeps the run's checkpoints only as far back as this host's directory does."""
        kept = [step_of(p) for p in self.root.glob("step-*")]
        if not kept:
            return
        for entry in (await c.status())["stored"]:
            if entry["model"] == run_model(self.run) and step_of(Path(entry["version"])) < min(kept):
                await c.remove(entry["version_id"])
                self.seeded.pop(entry["version"], None)
