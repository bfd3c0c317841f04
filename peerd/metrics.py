"""Prometheus metrics for one peerd (own registry, so several daemons can live in one test process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class PeerdMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.bytes_in = Counter("peerd_download_bytes_total", "Chunk bytes received and verified, second "
                                "copies included (peerd_duplicate_bytes_total)", ["source"], registry=r)
        self.duplicate_bytes = Counter("peerd_duplicate_bytes_total", "Bytes received for a chunk verified meanwhile "
                                       "(endgame's second source, an answer that came after its request was given up)",
                                       registry=r)
        self.refetched_bytes = Counter("peerd_refetched_bytes_total", "Bytes of chunks requested again after they "
                                       "were verified here (a bug if it ever moves)", registry=r)
        self.bytes_out = Counter("peerd_upload_bytes_total", "Chunk bytes served to peers", registry=r)
        self.chunks = Counter("peerd_chunks_verified_total", "Chunks verified and made durable", ["source"], registry=r)
        self.failures = Counter("peerd_chunk_failures_total", "Failed chunk fetches", ["reason"], registry=r)
        self.uploads_aborted = Counter("peerd_upload_aborted_total",
                                       "Uploads the requester abandoned (endgame duplicates, slow peers)", registry=r)
        self.corrupt_on_disk = Counter("peerd_chunks_corrupt_on_disk_total",
                                       "Verified chunks whose bytes changed on disk (found before serving)", registry=r)
        self.gossip = Counter("peerd_gossip_messages_total", "Gossip rounds and bitmap pushes answered",
                              ["direction"], registry=r)
        self.have_frames = Counter("peerd_have_frames_total", "Exchanges over HAVE streams (a subset of the gossip "
                                   "messages)", ["direction"], registry=r)
        self.have_links = Gauge("peerd_have_links", "Open HAVE links", ["direction"], registry=r)
        self.busy = Counter("peerd_upload_busy_total", "Uploads refused with 503 (at max_uploads)", registry=r)
        self.quarantined = Gauge("peerd_quarantined_peers", "Peers quarantined for serving bad chunks", registry=r)
        self.peers_alive = Gauge("peerd_peers_alive", "Members currently considered alive", registry=r)
        self.job_failures = Counter("peerd_job_failures_total", "Versions whose fetch failed (disk_full, internal...)",
                                    ["code"], registry=r)
        self.store_cpu = Counter("peerd_store_cpu_seconds_total", "CPU seconds of the store by stage: allocate "
                                 "(pre-allocating a version's files), hash (checking chunk digests), write (pwrite "
                                 "and fdatasync of chunk and bitmap)", ["stage"], registry=r)
        self.progress = Gauge("peerd_version_progress_ratio", "Verified fraction of a version", ["version"], registry=r)
