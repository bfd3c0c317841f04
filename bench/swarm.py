"""`weightcast bench swarm`: real peerd processes, the origin in SeaweedFS.

On loopback (the default) every host is rate-limited to R up and down by peerd's own pacer; origin
reads are limited to R in total (R / seeders per seeding host, as one seed host's link would be).
With ``--netns`` every host and the origin get a network namespace of their own behind a link the
kernel shapes to R both ways, hosts in ``--racks`` racks whose uplinks may be oversubscribed
(lib/netns.py); peerd runs unpaced, so the kernel and TCP set the pace. The controller (this
benchmark) then runs in the topology's control namespace. Faults there are the network's: a rack
partitioned from the spine for a while, a host's link down for a while. Time runs from the moment all hosts are told to
fetch (daemons already up and gossiping) to each host holding the whole verified checkpoint.
Reported besides: the daemons' and the origin's CPU per GiB (from /proc), the daemons' split into the
stages their stores meter (allocate, hash, write; the rest is "other"), and, with ``warm_pages``,
what writing the hosts' bytes cost before the clock, on memory the VM had not touched lately.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peerd import digests
from peerd import manifest as mf
from peerd.client import PeerdClient
from peerd.origin import OriginSpec, S3Origin
from bench.throughput import cpu_seconds, stage_cpu, write_cpu_s_per_gib
from lib.netns import PAYLOAD_SHARE, Topology
from peerd.signing import generate_keypair, load_private_key
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.stack.peerd_proc import PeerdProc, fleet_args
from lib.ports import free_ports
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3


@dataclass
class SwarmBenchConfig:
    hosts: int = 8
    size: int = 256 * 1024 * 1024
    rate: float = 16 * 1024 * 1024
    chunk: int = 1024 * 1024
    kill: int = 0
    corrupt_peers: int = 0
    max_uploads: int | None = None         # peerd's --max-uploads (default: peerd's own)
    have_interval: float | None = None     # peerd's --have-interval (default: peerd's own)
    have_stream: bool = True               # False: peerd's --no-have-stream (pushes as HTTP POSTs)
    warm_pages: bool = True                # write and free the hosts' bytes before the clock (a VM's first touch)
    timeout: float = 600.0
    workdir: Path | None = None            # kept afterwards when given
    checkpoint: Callable[[Path], Path] | None = None   # writes the checkpoint; default random bytes
    model: str = "bench"
    version: str = "v1"
    netns: bool = False                    # hosts in namespaces on kernel-shaped links (lib/netns.py)
    racks: int = 1                         # netns: hosts split evenly over this many racks
    oversubscription: float = 1.0          # netns: rack uplink = rack hosts x R / this
    partition_s: float = 0.0               # netns: the last rack cut from the spine this long, from 0.3 x S/R
    link_down_s: float = 0.0               # netns: the last host's link down this long, from 0.3 x S/R
    loss: float = 0.0                      # netns: share of packets each host and the origin drop on arrival


def _verify_host(store: Path, m: mf.Manifest) -> tuple[bool, int]:
    """(files identical to the source, chunks marked present whose bytes do not match)."""
    vdir = store / "versions" / m.digest
    bits = (vdir / "bitmap").read_bytes()
    bad = 0
    for c in m.chunks:
        if bits[c.index]:
            with open(vdir / "model" / c.file, "rb") as f:
                f.seek(c.offset)
                if digests.hexdigest(m.hash_algorithm, f.read(c.size)) != c.digest:
                    bad += 1
    ok = all(bits) and bad == 0
    return ok, bad


async def run_swarm_bench(cfg: SwarmBenchConfig, progress=None) -> dict:
    if cfg.netns:
        return await asyncio.to_thread(_in_topology, cfg)
    return await _run(cfg, None, progress)


def _in_topology(cfg: SwarmBenchConfig) -> dict:
    """Build the topology, run the benchmark's controller inside its control namespace, tear it down."""
    if cfg.checkpoint is not None:
        raise ValueError("--netns runs the benchmark in another process: a random checkpoint only")
    if cfg.racks < 1 or cfg.hosts % cfg.racks:
        raise ValueError(f"{cfg.hosts} hosts do not split evenly over {cfg.racks} racks")
    per_rack = cfg.hosts // cfg.racks
    with Topology([per_rack] * cfg.racks, cfg.rate, cfg.rate, cfg.oversubscription, control=True,
                  loss=cfg.loss) as net:
        spec = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
                if k != "checkpoint"}
        proc = subprocess.run(net.controller.run(sys.executable, "-m", "bench.swarm", "--inside",
                                                 json.dumps({"cfg": spec, "net": net.describe()})),
                              capture_output=True, text=True, timeout=cfg.timeout + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"the benchmark's controller failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


async def _run(cfg: SwarmBenchConfig, net: Topology | None, progress=None) -> dict:
    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="wc-bench-"))
    s3 = (SeaweedS3(work / "s3", ip=net.origin.addr, prefix=tuple(net.origin.run())) if net else
          SeaweedS3(work / "s3")).start()
    procs: list[PeerdProc] = []
    try:
        ckpt = cfg.checkpoint(work / "ckpt") if cfg.checkpoint else write_random_checkpoint(work / "ckpt", cfg.size, files=3)
        generate_keypair(work / "key.pem", work / "key.pub")
        m = mf.build_from_directory(ckpt, cfg.model, cfg.version, cfg.chunk)
        signed = mf.sign_manifest(m, load_private_key(work / "key.pem"))
        spec = OriginSpec(s3.endpoint, s3.bucket, "bench/v1")
        async with S3Origin(spec, ACCESS_KEY, SECRET_KEY) as o:
            await o.ensure_bucket()
            await o.upload_directory(ckpt)
        token = secrets.token_hex(16)
        ids = [f"h{i}" for i in range(cfg.hosts)]
        ports = dict(zip(ids, free_ports(cfg.hosts)))
        place = {h.name: h for h in net.hosts} if net else {}      # netns: each host's namespace and address
        corrupt = set(ids[1:1 + cfg.corrupt_peers])
        seeders = [i for i in ids if i not in corrupt]
        for i in ids:
            extra = ["--fault-corrupt-uploads"] if i in corrupt else []
            if cfg.max_uploads:
                extra += ["--max-uploads", str(cfg.max_uploads)]
            if cfg.have_interval:
                extra += ["--have-interval", str(cfg.have_interval)]
            if not cfg.have_stream:
                extra += ["--no-have-stream"]
            if net:                    # unpaced: the kernel-shaped links are the limit
                args = fleet_args(i, ports, trusted_key=work / "key.pub", rate=None, origin_rate=None,
                                  extra=extra, hosts={h: place[h].addr for h in ids},
                                  racks={h: f"r{place[h].rack}" for h in ids})
                procs.append(PeerdProc(i, ports[i], work / "hosts" / i / "store", args, env=s3.env(),
                                       host=place[i].addr, netns=place[i].ns, token=token))
            else:
                args = fleet_args(i, ports, trusted_key=work / "key.pub", rate=cfg.rate,
                                  origin_rate=cfg.rate / len(seeders), extra=extra)
                procs.append(PeerdProc(i, ports[i], work / "hosts" / i / "store", args, env=s3.env(), token=token))
        for p in procs:
            p.start()
        await asyncio.sleep(1.5)   # let gossip introduce everyone before the clock starts
        origin = {"endpoint": s3.endpoint, "bucket": s3.bucket, "prefix": "bench/v1"}
        clients = [PeerdClient(p.addr, token) for p in procs]
        for c in clients:
            await c.__aenter__()
        # the VM's first touch of memory (bench/throughput.py): write and free what the hosts will store
        cold_write = write_cpu_s_per_gib(work, m.total_size * cfg.hosts) if cfg.warm_pages else None
        stages0 = {p.id: await stage_cpu(c) for p, c in zip(procs, clients)}
        cpu0 = {p.id: cpu_seconds(p.proc.pid) for p in procs}
        origin_cpu0 = cpu_seconds(s3.proc.pid)
        rack_in0 = [net.tx_bytes(f"s{k}") for k in range(cfg.racks)] if net and cfg.racks > 1 else []
        faults = _Faults(cfg, net, m.total_size / cfg.rate)
        t0 = time.time()
        await asyncio.gather(*(c.start_job(signed, origin, seeders) for c in clients))
        lower = m.total_size / cfg.rate
        victims = [p for p in procs if p.id not in corrupt][-cfg.kill:] if cfg.kill else []
        killed: set[str] = set()
        crashed: dict[str, dict] = {}   # daemons that died on their own: how, and their last log lines
        last: dict[str, dict] = {}
        origin_done = None          # when the origin had delivered one full copy, fleet-wide
        timed_out = False
        while True:
            now = time.time() - t0
            if victims and not killed and now > 0.4 * lower:
                for v in victims:
                    v.kill()
                    killed.add(v.id)
            faults.at(now)
            for p in procs:
                if p.id not in killed and p.id not in crashed and (death := p.death()) is not None:
                    crashed[p.id] = death
            gone = killed | set(crashed)
            # a bounded poll: a partitioned host's request must not hold up the loop (and so the healing)
            sts = await asyncio.gather(*(asyncio.wait_for(c.job(m.digest), 2.0) for p, c in zip(procs, clients)
                                         if p.id not in gone), return_exceptions=True)
            for p, st in zip([p for p in procs if p.id not in gone], sts):
                if isinstance(st, dict):
                    last[p.id] = st
            live = [p.id for p in procs if p.id not in gone]
            if origin_done is None and sum(st["bytes_by_source"]["origin"] for st in last.values()) >= m.total_size:
                origin_done = now
            if progress:
                progress(now, sum(last[i]["bytes_done"] for i in live if i in last), len(live) * m.total_size)
            if all(i in last and last[i]["state"] in ("complete", "failed") for i in live):
                break
            if now > cfg.timeout:      # the deadline: report who is where, do not wait forever
                timed_out = True
                break
            await asyncio.sleep(0.1)
        faults.heal()
        survivors = [i for i in ids if i not in killed and i not in crashed]
        wall = time.time() - t0
        rack_in = [net.tx_bytes(f"s{k}") - b for k, b in enumerate(rack_in0)]
        # where the machine's CPU went: the daemons' own time (from /proc) and their gossip rate
        peerd_cpu = sum(cpu_seconds(p.proc.pid) - cpu0[p.id] for p in procs if p.id in survivors and p.running)
        origin_cpu = cpu_seconds(s3.proc.pid) - origin_cpu0
        gossip_sent = 0.0
        stages = {"allocate": 0.0, "hash": 0.0, "write": 0.0}
        for p, c in zip(procs, clients):
            if p.id in survivors and p.running:
                gossip_sent += await c.metric('peerd_gossip_messages_total{direction="sent"}')
                for k, v in (await stage_cpu(c)).items():
                    stages[k] += v - stages0[p.id][k]
        quarantined = set()
        for p, c in zip(procs, clients):
            if p.id in survivors and p.id not in corrupt and p.running:
                quarantined |= set((await c.status())["quarantined"])
        for c in clients:
            await c.__aexit__(None, None, None)
        finish = {i: round(last[i]["finished"] - t0, 2) for i in survivors
                  if i in last and last[i]["state"] == "complete"}
        times = sorted(finish.values())
        failed = [i for i in survivors if i not in last or last[i]["state"] != "complete"]
        origin_bytes = sum(st["bytes_by_source"]["origin"] for st in last.values())
        checks = {i: _verify_host(work / "hosts" / i / "store", m) for i in survivors
                  if i not in corrupt and i not in failed}
        pct = lambda q: times[min(len(times) - 1, int(q * len(times)))] if times else None
        by_rack = {k: [i for i in ids if place[i].rack == k] for k in range(cfg.racks)} if net else {}
        net_res = {} if not net else {
            "netns": True, "racks": cfg.racks, "oversubscription": cfg.oversubscription,
            "partition_s": cfg.partition_s, "link_down_s": cfg.link_down_s, "loss": cfg.loss, "faults": faults.log,
            "congestion": net.congestion,
            # the kernel-shaped link carries headers too: T* on payload alone
            "payload_share": PAYLOAD_SHARE, "lower_bound_payload_s": lower / PAYLOAD_SHARE,
            # every rack needs one copy in through its uplink (the origin is on the spine too)
            "lower_bound_topology_s": _topology_bound(cfg, m.total_size) / PAYLOAD_SHARE,
            "ratio_topology": (times[-1] * PAYLOAD_SHARE / _topology_bound(cfg, m.total_size)) if times else None,
            "ratio_payload": (times[-1] / (lower / PAYLOAD_SHARE)) if times else None,
            # copies of the checkpoint entering each rack from the spine (kernel counters, payload
            # share applied), and those that came from other racks' hosts rather than the origin
            "rack_ingress_copies": [round(b * PAYLOAD_SHARE / m.total_size, 3) for b in rack_in],
            "cross_rack_copies_per_rack": [
                round(max(0.0, rack_in[k] * PAYLOAD_SHARE - sum(last[i]["bytes_by_source"]["origin"]
                                                                for i in by_rack[k] if i in last)) / m.total_size, 3)
                for k in range(len(rack_in))]}
        return {**net_res,"hosts": cfg.hosts, "size": m.total_size, "version_id": m.digest, "workdir": str(work), "rate": cfg.rate, "chunk": cfg.chunk, "chunks": len(m.chunks),
                "killed": sorted(killed), "corrupt_peers": sorted(corrupt), "failed": failed,
                "crashed": crashed, "timed_out": timed_out, "deadline_s": cfg.timeout,
                "incomplete": {i: {"state": last[i]["state"] if i in last else "unknown",
                                   "chunks_done": last[i]["chunks_done"] if i in last else None,
                                   "error": last[i].get("error") if i in last else None} for i in failed},
                "lower_bound_s": lower, "finish_s_by_host": finish,
                "p50_s": pct(0.5), "p90_s": pct(0.9), "max_s": times[-1] if times else None,
                "ratio": (times[-1] / lower) if times else None,
                "origin_copies": origin_bytes / m.total_size,
                # where the time goes: the origin's one copy (ideally at lower_bound_s), then the spread of the
                # last chunks (tail_s); polled every 0.1 s
                "origin_done_s": origin_done, "tail_s": (times[-1] - origin_done) if times and origin_done else None,
                "all_verified": all(ok for ok, _ in checks.values()) and not failed and not crashed,
                "corrupt_chunks_accepted": sum(bad for _, bad in checks.values()),
                "quarantined_by_honest_hosts": sorted(quarantined),
                "peerd_cores": peerd_cpu / wall, "gossip_sent_per_host_s": gossip_sent / max(len(survivors), 1) / wall,
                # CPU per GiB: each surviving daemon received (and re-served about) one copy; the origin
                # (SeaweedFS, one process) served origin_copies of it
                "peerd_cpu_s_per_gib_received": peerd_cpu / max(1e-9, len(survivors) * m.total_size / 2**30),
                "peerd_stages_cpu_s_per_gib": {**{k: v / max(1e-9, len(survivors) * m.total_size / 2**30)
                                                  for k, v in stages.items()},
                                               "other": (peerd_cpu - sum(stages.values()))
                                               / max(1e-9, len(survivors) * m.total_size / 2**30)},
                "warm_pages": cfg.warm_pages, "write_cold_cpu_s_per_gib": cold_write,
                "origin_cpu_s": origin_cpu,
                "origin_cpu_s_per_gib_served": origin_cpu / max(1e-9, origin_bytes / 2**30),
                "machine_cores": os.cpu_count(),
                # chunks requested again after they were verified (must be 0); endgame's second sources
                # whose copy arrived after the first (both requested while the chunk was missing) are apart
                "refetched_bytes": sum(last[i]["refetched_bytes"] for i in survivors if i in last),
                "endgame_duplicate_bytes": sum(last[i]["duplicate_bytes"] for i in survivors if i in last)}
    finally:
        for p in procs:
            p.stop()
        s3.stop()
        if cfg.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _topology_bound(cfg: SwarmBenchConfig, size: int) -> float:
    """S over the narrowest rate a copy must cross: a host's link, or a rack's uplink when racks share one."""
    uplink = cfg.hosts // cfg.racks * cfg.rate / cfg.oversubscription if cfg.racks > 1 else cfg.rate
    return size / min(cfg.rate, uplink)


class _Faults:
    """The network faults of a netns run, started at 0.3 x S/R and healed after their duration."""

    def __init__(self, cfg: SwarmBenchConfig, net: Topology | None, lower: float):
        self.cfg, self.net, self.start = cfg, net, 0.3 * lower
        self.log: list[dict] = []
        self.active: list[tuple[float, str]] = []         # (heal at, which)

    def at(self, now: float) -> None:
        if self.net is None:
            return
        if not self.log and now >= self.start:
            if self.cfg.partition_s:
                self.net.rack_uplink(self.cfg.racks - 1, False)
                self.active.append((now + self.cfg.partition_s, "partition"))
                self.log.append({"t": round(now, 2), "event": f"rack {self.cfg.racks - 1} partitioned"})
            if self.cfg.link_down_s:
                self.net.link(self.net.hosts[-1], False)
                self.active.append((now + self.cfg.link_down_s, "link"))
                self.log.append({"t": round(now, 2), "event": f"{self.net.hosts[-1].name}'s link down"})
        for heal_at, which in [a for a in self.active if now >= a[0]]:
            self._heal(which, now)

    def _heal(self, which: str, now: float | None) -> None:
        self.active = [a for a in self.active if a[1] != which]
        if which == "partition":
            self.net.rack_uplink(self.cfg.racks - 1, True)
        else:
            self.net.link(self.net.hosts[-1], True)
        self.log.append({"t": None if now is None else round(now, 2), "event": f"{which} healed"})

    def heal(self) -> None:
        for _, which in list(self.active):
            self._heal(which, None)


def main_json(cfg: SwarmBenchConfig) -> str:
    return json.dumps(asyncio.run(run_swarm_bench(cfg)), indent=1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inside":       # the controller, inside the control namespace
        a = json.loads(sys.argv[2])
        inner = SwarmBenchConfig(**{**a["cfg"], "netns": False,
                                    "workdir": Path(a["cfg"]["workdir"]) if a["cfg"]["workdir"] else None})
        print(json.dumps(asyncio.run(_run(inner, Topology.view(a["net"])))))
