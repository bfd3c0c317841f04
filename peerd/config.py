"""peerd's configuration, with its defaults documented in one place (see docs/peerd.md)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from peerd.policy import PolicyConfig


@dataclass
class PeerdConfig:
    host_id: str                                # unique in the fleet; the host worker's queue is host-<id>
    store: Path                                 # where versions are assembled
    listen_host: str = "127.0.0.1"
    port: int = 7700                            # 0 picks a free port (written to ready_file)
    advertise: str | None = None                # address peers use; default http://listen_host:port
    rack: str = ""
    token: str = ""                             # cluster token; empty disables auth (dev only)
    trusted_keys: list[Path] = field(default_factory=list)
    seed_peers: list[dict] = field(default_factory=list)   # [{id, addr, rack}]
    upload_rate: float | None = None            # bytes/s; None = unlimited
    download_rate: float | None = None
    origin_rate: float | None = None            # bytes/s this host may read from the origin
    max_uploads: int = 8                        # concurrent chunk uploads before answering 503 busy (= max_inflight: docs/peerd.md)
    gossip_interval: float = 1.0                # seconds between gossip rounds
    gossip_fanout: int = 3                      # random peers per round (plus active swarm peers)
    have_interval: float = 0.025                # a verified chunk is pushed to the active peers within this
    have_refresh: float = 0.1                   # pushes to active peers without news (load, liveness) while busy
    have_stream: bool = True                    # pushes to the active swarm over HAVE links (else HTTP POSTs)
    dead_after: float = 5.0                     # seconds without hearing from a peer → dead
    stall_after: float = 2.0                    # a chunk download that receives nothing this long is given up
                                                # and asked elsewhere (a host that died mid-upload), before dead_after
    max_active_peers: int = 32                  # peers a job's policy tracks
    max_members: int = 10_000                   # members this host remembers (gossip cannot grow it further)
    reserve_bytes: int = 0                      # free space to keep on the store volume
    header_timeout: float = 10.0                # a connection must send a whole request head within this
    body_timeout: float = 60.0                  # ...and a request's whole body within this of its head
    max_connections: int = 4096                 # beyond this, connections that made no request are closed
    keepalive_timeout: float = 75.0             # idle keep-alive connections are closed after this
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ready_file: Path | None = None
    fault_corrupt_uploads: bool = False         # test-only fault injection: serve flipped bytes


def default(name: str):
    """PeerdConfig's default for one field: the command line and the simulator read it from here,
    so the number has one owner."""
    for f in fields(PeerdConfig):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise KeyError(f"PeerdConfig has no default for {name!r}")
