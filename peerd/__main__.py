"""Run one peerd: ``python -m peerd --id h1 --store /var/lib/weightcast ...`` (see docs/peerd.md)."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from peerd.config import PeerdConfig, default
from peerd.daemon import Daemon
from lib.secret_input import CLUSTER_TOKEN, add_secret_file_arg, read_secret
from lib.logging_setup import setup
from peerd.policy import PolicyConfig
from peerd.units import parse_rate


def parse_peer(s: str) -> dict:
    """id=http://host:port[@rack]"""
    pid, _, rest = s.partition("=")
    addr, _, rack = rest.partition("@")
    if not pid or not addr:
        raise argparse.ArgumentTypeError(f"peer {s!r} must look like id=http://host:port[@rack]")
    return {"id": pid, "addr": addr, "rack": rack}


def rate(s: str) -> float | None:
    """bytes/s: '1.1G', '500M', '10Gbit' or a number; '0'/'none' = unlimited."""
    return None if s in ("", "0", "none") else parse_rate(s)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="peerd", description="weightcast per-host data-plane daemon")
    ap.add_argument("--id", required=True, help="host id, unique in the fleet")
    ap.add_argument("--store", required=True, type=Path, help="directory versions are assembled in")
    ap.add_argument("--listen", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=default("port"), help="port (0 = pick a free one; see --ready-file)")
    ap.add_argument("--advertise", help="address peers use, default http://<listen>:<port>")
    ap.add_argument("--rack", default="")
    add_secret_file_arg(ap, CLUSTER_TOKEN, "cluster token (empty disables peer auth: development only)")
    ap.add_argument("--trusted-key", action="append", type=Path, default=[], help="Ed25519 public key (PEM)")
    ap.add_argument("--peer", action="append", type=parse_peer, default=[], help="seed peer id=addr[@rack]")
    ap.add_argument("--upload-rate", type=rate, default=None, help="bytes/s (default unlimited)")
    ap.add_argument("--download-rate", type=rate, default=None, help="bytes/s (default unlimited)")
    ap.add_argument("--origin-rate", type=rate, default=None, help="bytes/s of origin reads (default unlimited)")
    ap.add_argument("--max-uploads", type=int, default=default("max_uploads"), help="concurrent chunk uploads before 503 busy")
    ap.add_argument("--max-cross-rack-peers", type=int, default=PolicyConfig().max_cross_rack_peers,
                    help="peers in other racks a download tracks at once")
    ap.add_argument("--gossip-interval", type=float, default=default("gossip_interval"))
    ap.add_argument("--have-interval", type=float, default=default("have_interval"),
                    help="a verified chunk is pushed to the active peers within this many seconds")
    ap.add_argument("--have-refresh", type=float, default=default("have_refresh"),
                    help="pushes to active peers without news (upload load, liveness) while busy")
    ap.add_argument("--no-have-stream", dest="have_stream", action="store_false", default=default("have_stream"),
                    help="push to the active swarm with HTTP POSTs instead of HAVE links (docs/peerd.md)")
    ap.add_argument("--dead-after", type=float, default=default("dead_after"))
    ap.add_argument("--stall-after", type=float, default=default("stall_after"),
                    help="a chunk download that receives nothing this long is given up and asked elsewhere")
    ap.add_argument("--header-timeout", type=float, default=default("header_timeout"),
                    help="seconds a connection may take to send a request head (default 10)")
    ap.add_argument("--body-timeout", type=float, default=default("body_timeout"),
                    help="seconds a request's body may take to arrive after its head (default 60)")
    ap.add_argument("--max-connections", type=int, default=default("max_connections"), help="open connections before silent ones are shed")
    ap.add_argument("--max-members", type=int, default=default("max_members"), help="members remembered (bounds what gossip can add)")
    ap.add_argument("--reserve-bytes", type=int, default=default("reserve_bytes"), help="free space to keep on the store volume")
    ap.add_argument("--ready-file", type=Path, help="write {addr,id} JSON here once listening")
    ap.add_argument("--fault-corrupt-uploads", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log-level", default="INFO")
    return ap


def config_from_args(a) -> PeerdConfig:
    return PeerdConfig(host_id=a.id, store=a.store, listen_host=a.listen, port=a.port, advertise=a.advertise,
                       rack=a.rack, token=read_secret(a, CLUSTER_TOKEN), trusted_keys=a.trusted_key, seed_peers=a.peer,
                       upload_rate=a.upload_rate, download_rate=a.download_rate, origin_rate=a.origin_rate,
                       gossip_interval=a.gossip_interval, have_interval=a.have_interval,
                       have_refresh=a.have_refresh, have_stream=a.have_stream, dead_after=a.dead_after, stall_after=a.stall_after,
                       reserve_bytes=a.reserve_bytes, max_members=a.max_members,
                       header_timeout=a.header_timeout, body_timeout=a.body_timeout,
                       max_connections=a.max_connections,
                       ready_file=a.ready_file, max_uploads=a.max_uploads,
                       fault_corrupt_uploads=a.fault_corrupt_uploads,
                       policy=PolicyConfig(max_cross_rack_peers=a.max_cross_rack_peers))


async def serve(cfg: PeerdConfig) -> None:
    d = Daemon(cfg)
    await d.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    await d.stop()


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    setup(a.log_level)
    if not a.trusted_key:
        print(json.dumps({"level": "ERROR", "msg": "no --trusted-key given: peerd would refuse every manifest"}),
              file=sys.stderr)
        return 2
    asyncio.run(serve(config_from_args(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
