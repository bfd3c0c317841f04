"""`weightcast sim`, `weightcast bench ...` and `weightcast gpu-check`: the simulator and the benchmarks."""
from __future__ import annotations

import asyncio
import json
import sys
import time

from peerd import manifest as mf
from peerd.config import default as peerd_default
from peerd.digests import ALGORITHMS
from peerd.policy import PolicyConfig
from peerd.seeders import MAX_SEEDERS
from peerd.units import parse_rate, parse_size
from weightcast.cli.common import HASH_HELP, WARM_HELP, Progress, positive_int


def cmd_sim(a) -> int:
    import dataclasses

    from peerd.policy import PolicyConfig
    from peerd.sim.config import SimConfig
    policy = dataclasses.replace(PolicyConfig(), **{k: getattr(a, k) for k in _SIM_POLICY_FLAGS})
    cfg = SimConfig(hosts=a.hosts, size=a.size, chunk=a.chunk, rate=a.rate, racks=a.racks,
                    oversubscription=a.oversubscription, fail_fraction=a.fail, seeders=a.seeders, seed=a.seed,
                    policy=policy, **{k: getattr(a, k) for k in _SIM_PEERD_FLAGS})
    if a.engine == "policies":            # the daemon's own policy objects, one per host (small fleets)
        if a.oversubscription > 1:
            print("error: --engine policies models no rack uplinks (every link is a host's); use --engine fleet "
                  "for oversubscribed racks", file=sys.stderr)
            return 2
        from peerd.sim.policies import simulate_policies
        res = simulate_policies(cfg)
    else:
        from peerd.sim.fleet import simulate
        bar, t0 = Progress("sim"), time.monotonic()     # simulated time against the bound, wall time shown
        res = simulate(cfg, progress=lambda now, lower, done, n: bar(time.monotonic() - t0, min(now, lower), lower))
        bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


_SIM_POLICY_FLAGS = ("max_inflight", "seeder_inflight", "max_per_peer", "window", "plan_size", "rack_grace_s",
                     "rack_rescue_s", "max_cross_rack_peers", "origin_spread")


_SIM_PEERD_FLAGS = ("max_active_peers", "max_uploads", "have_interval", "dead_after", "stall_after")


def _swarm_config(a):
    from bench.swarm import SwarmBenchConfig
    deadline = a.deadline or 60 + 5 * a.size / a.rate     # never wait forever on a hung or dead host
    return SwarmBenchConfig(hosts=a.hosts, size=a.size, rate=a.rate, chunk=a.chunk, kill=a.kill,
                            corrupt_peers=a.corrupt_peers, max_uploads=a.max_uploads,
                            have_interval=a.have_interval, have_stream=a.have_stream, timeout=deadline,
                            warm_pages=a.warm_pages, **{k: getattr(a, k) for k in NETNS_FLAGS if hasattr(a, k)})


NETNS_FLAGS = ("netns", "racks", "oversubscription", "partition_s", "link_down_s", "loss")


def cmd_bench_swarm(a) -> int:
    from bench.swarm import run_swarm_bench
    bar = Progress("swarm")
    res = asyncio.run(run_swarm_bench(_swarm_config(a), progress=bar))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["all_verified"] and res["corrupt_chunks_accepted"] == 0 else 1


def cmd_bench_manifest(a) -> int:
    from bench.manifest_scale import run_manifest_bench
    res = run_manifest_bench([int(x) for x in a.chunks.split(",")], a.files)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_allreduce(a) -> int:
    from bench.allreduce import method_config, run_allreduce_bench
    method_config(a.ranks, a.steps, a.set)          # bad settings: exit 2 before the namespace is entered
    res = run_allreduce_bench(a.ranks, a.link, a.steps, a.set)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_throughput(a) -> int:
    from bench.throughput import run_throughput_bench
    res = asyncio.run(run_throughput_bench(a.size, a.chunk, a.downloaders, algorithm=a.hash,
                                           warm_pages=a.warm_pages))
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if not res["failed"] else 1


def cmd_bench_gossip(a) -> int:
    from bench.gossip import run_gossip_bench
    print(json.dumps(asyncio.run(run_gossip_bench(a.exchanges, a.rounds, a.peers)), indent=None if a.json else 1))
    return 0


def cmd_bench_receive(a) -> int:
    from bench.receive import run_receive_bench
    print(json.dumps(run_receive_bench(a.size, a.count, a.rounds), indent=None if a.json else 1))
    return 0


def cmd_bench_rebalance(a) -> int:
    from bench.rebalance import rebalance_config, run_rebalance_bench
    rebalance_config(a.ranks, a.steps, a.batch_per_rank, a.set)     # bad settings: exit 2 first
    res = run_rebalance_bench(a.ranks, a.slowdown, a.steps, a.batch_per_rank, a.set, a.link)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_train(a) -> int:
    from bench.train_layouts import run_layout_bench
    res = run_layout_bench(a.layouts.split(","), a.ranks, a.steps, a.set, a.model)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_train_recovery(a) -> int:
    from bench.train_recovery import run_train_recovery_bench
    res = run_train_recovery_bench(a.ranks, a.steps, a.kill_at, a.every, a.set)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["workflow"]["final_loss_matches"] else 1


def cmd_bench_soak(a) -> int:
    from bench.soak import run_soak
    bar, t0 = Progress("soak"), time.monotonic()
    res = asyncio.run(run_soak(_swarm_config(a), a.swarms, progress=lambda k, n: bar(time.monotonic() - t0, k, n)))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["crashed_daemons"] == 0 and res["unverified_swarms"] == 0 else 1


def cmd_bench_load(a) -> int:
    from bench.load import run_load_bench
    res = run_load_bench(a.size, a.repeats, algorithm=a.hash, engine=a.engine)
    print(json.dumps(res, indent=None if a.json else 1))
    return 0


def cmd_bench_engine(a) -> int:
    from bench.engine import run_engine_bench
    print(json.dumps(run_engine_bench(a.engine), indent=None if a.json else 1))
    return 0


def cmd_gpu_check(a) -> int:
    from bench.gpu_check import main as gpu_check
    return gpu_check()


def cmd_bench_router(a) -> int:
    from bench.router import run_router_bench
    print(json.dumps(run_router_bench(a.engine, a.requests), indent=None if a.json else 1))
    return 0


def cmd_bench_rollout_shape(a) -> int:
    from bench.rollout_shape import main_json
    print(main_json(a.hosts, a.racks, a.max_loads, a.max_history_events))
    return 0


def cmd_bench_rollout(a) -> int:
    from bench.rollout import run_rollout_bench
    bar = Progress("rollout")
    res = asyncio.run(run_rollout_bench(a.hosts, a.size, a.rate, a.step_wait, lambda t, d, n, phase: bar(t, d, n)))
    bar.close()
    print(json.dumps(res, indent=None if a.json else 1))
    return 0 if res["ok"] else 1


def _swarm_flags(p, *, hosts: int, size: str, rate: str, chunk: str, kill: int, corrupt: int) -> None:
    """The flags of one real-process swarm (bench swarm, and each swarm of bench soak)."""
    p.add_argument("--hosts", type=int, default=hosts)
    p.add_argument("--size", type=parse_size, default=parse_size(size))
    p.add_argument("--rate", type=parse_rate, default=parse_rate(rate))
    p.add_argument("--chunk", type=parse_size, default=parse_size(chunk))
    p.add_argument("--kill", type=int, default=kill, help="hosts SIGKILLed at 40%% of the lower bound (per swarm)")
    p.add_argument("--corrupt-peers", type=int, default=corrupt, help="hosts that serve flipped bytes (per swarm)")
    p.add_argument("--max-uploads", type=int, default=None, help="peerd's --max-uploads (default: peerd's own)")
    p.add_argument("--have-interval", type=float, default=None, help="peerd's --have-interval (default: peerd's own)")
    p.add_argument("--no-have-stream", dest="have_stream", action="store_false",
                   help="peerd's --no-have-stream: pushes as HTTP POSTs (the A/B of docs/peerd.md)")
    p.add_argument("--deadline", type=float, default=None, help="seconds per swarm before giving up (default 60 + 5 S/R)")
    p.add_argument("--no-warm-pages", dest="warm_pages", action="store_false", help=WARM_HELP)
    p.add_argument("--json", action="store_true")


def _training_bench_flags(p, *, steps: int) -> None:
    """The flags every training benchmark takes."""
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TrainConfig overrides")
    p.add_argument("--json", action="store_true")


def register(sub) -> None:
    """Add this area's subcommands to the `weightcast` parser."""
    s = sub.add_parser("sim", help="simulate the swarm at fleet scale (peerd's rules over a fluid link model)")
    s.add_argument("--engine", choices=("fleet", "policies"), default="fleet",
                   help="fleet: batched rules, 10,000 hosts; policies: one SwarmPolicy object per host (small fleets)")
    s.add_argument("--hosts", type=int, default=1000)
    s.add_argument("--size", type=parse_size, default=parse_size("400GB"))
    s.add_argument("--chunk", type=parse_size, default=parse_size("64M"))
    s.add_argument("--rate", type=parse_rate, default=parse_rate("10Gbit"))
    s.add_argument("--racks", type=int, default=20)
    s.add_argument("--oversubscription", type=float, default=1.0, help="rack uplink = hosts x rate / this")
    s.add_argument("--fail", type=float, default=0.05, help="fraction of hosts that die mid-run")
    s.add_argument("--seeders", type=int, default=MAX_SEEDERS,
                   help=f"hosts that read the origin, round-robin over the racks (default {MAX_SEEDERS}, as a rollout)")
    s.add_argument("--seed", type=int, default=1)
    # peerd's own settings: defaults are peerd's (PolicyConfig, PeerdConfig); names are theirs
    pol = PolicyConfig()
    for name in _SIM_POLICY_FLAGS:
        s.add_argument("--" + name.replace("_", "-"), type=type(getattr(pol, name)), default=getattr(pol, name),
                       help=f"PolicyConfig.{name} (default %(default)s)")
    for name in _SIM_PEERD_FLAGS:
        d = peerd_default(name)
        s.add_argument("--" + name.replace("_", "-"), type=type(d), default=d, help=f"peerd's {name} (default %(default)s)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_sim)

    bench = sub.add_parser("bench", help="benchmarks (print JSON)").add_subparsers(dest="sub", required=True)
    bs = bench.add_parser("swarm", help="real peerd processes on loopback, origin in SeaweedFS")
    _swarm_flags(bs, hosts=8, size="256M", rate="16M", chunk="1M", kill=0, corrupt=0)
    bs.add_argument("--netns", action="store_true",
                    help="each host and the origin in a network namespace behind a kernel-shaped link (root only)")
    bs.add_argument("--racks", type=positive_int, default=1, help="--netns: hosts split evenly over racks")
    bs.add_argument("--oversubscription", type=float, default=1.0,
                    help="--netns: a rack's uplink carries its hosts x rate / this")
    bs.add_argument("--partition", dest="partition_s", type=float, default=0.0,
                    help="--netns: cut the last rack from the spine for this many seconds, from 0.3 x S/R")
    bs.add_argument("--link-down", dest="link_down_s", type=float, default=0.0,
                    help="--netns: the last host's link down for this many seconds, from 0.3 x S/R")
    bs.add_argument("--loss", type=float, default=0.0,
                    help="--netns: share of packets each host drops on arrival, e.g. 0.01 (nftables: make netns-tools)")
    bs.set_defaults(fn=cmd_bench_swarm)

    bm = bench.add_parser("manifest", help="manifest cost at real chunk counts: parse, verify, layout, status; time and RSS")
    bm.add_argument("--chunks", default="6000,60000,400000", help="comma-separated chunk counts")
    bm.add_argument("--files", type=int, default=64, help="files the checkpoint is split into")
    bm.add_argument("--json", action="store_true")
    bm.set_defaults(fn=cmd_bench_manifest)

    ba = bench.add_parser("allreduce", help="gradient methods side by side, each rank behind its own kernel-shaped link (netns)")
    _training_bench_flags(ba, steps=30)
    ba.add_argument("--link", type=parse_rate, default=parse_rate("1Gbit"), help="the link's rate, e.g. 1Gbit")
    ba.set_defaults(fn=cmd_bench_allreduce)

    bp = bench.add_parser("throughput", help="peerd's cost per byte: one server, N downloaders, no limits; "
                                             "MiB/s and CPU-s/GiB per process (put TMPDIR on /dev/shm)")
    bp.add_argument("--size", type=parse_size, default=parse_size("1G"))
    bp.add_argument("--chunk", type=parse_size, default=parse_size("4M"))
    bp.add_argument("--downloaders", type=positive_int, default=1)
    bp.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    bp.add_argument("--no-warm-pages", dest="warm_pages", action="store_false", help=WARM_HELP)
    bp.add_argument("--json", action="store_true")
    bp.set_defaults(fn=cmd_bench_throughput)

    bv = bench.add_parser("receive", help="receive-side CPU per GiB: aiohttp vs peerd's chunk client "
                                          "(kept-alive, received in place into one reused buffer), alternating")
    bv.add_argument("--size", type=parse_size, default=parse_size("64M"), help="body (chunk) size")
    bv.add_argument("--count", type=positive_int, default=16, help="chunks per round and way")
    bv.add_argument("--rounds", type=positive_int, default=3)
    bv.add_argument("--json", action="store_true")
    bv.set_defaults(fn=cmd_bench_receive)
    bg = bench.add_parser("gossip", help="CPU of one push exchange with a real peerd: HTTP POST /v1/gossip vs a "
                                         "frame on a HAVE link, alternating")
    bg.add_argument("--exchanges", type=positive_int, default=3000, help="exchanges per round and way")
    bg.add_argument("--rounds", type=positive_int, default=2)
    bg.add_argument("--peers", type=positive_int, default=15, help="members pushing at once")
    bg.add_argument("--json", action="store_true")
    bg.set_defaults(fn=cmd_bench_gossip)
    br = bench.add_parser("rebalance", help="one slow data-parallel rank: equal shares vs rebalanced vs balanced")
    _training_bench_flags(br, steps=30)
    br.add_argument("--slowdown", type=float, default=2.0, help="the last rank computes this many times slower")
    br.add_argument("--batch-per-rank", type=int, default=16)
    br.add_argument("--link", type=parse_rate, default=None,
                    help="each rank in its own network namespace behind a kernel-shaped link of this rate")
    br.set_defaults(fn=cmd_bench_rebalance)

    bt = bench.add_parser("train", help="tokens/s of each parallelism layout, side by side")
    _training_bench_flags(bt, steps=20)
    bt.add_argument("--layouts", default="single,ddp,fsdp,tp,pp,fsdp_tp",
                    help="comma-separated layouts (fsdp_tp uses tp_degree=2 and needs --ranks 4)")
    bt.add_argument("--model", choices=("reference", "llama"), default="reference",
                    help="the model trained: weightcast's reference transformer or a Llama (transformers)")
    bt.set_defaults(fn=cmd_bench_train)
    btr = bench.add_parser("train-recovery", help="a rank killed mid-run: TrainingWorkflow vs torchrun --max-restarts")
    btr.add_argument("--ranks", type=positive_int, default=2)
    btr.add_argument("--steps", type=positive_int, default=60)
    btr.add_argument("--kill-at", type=positive_int, default=33, help="SIGKILL rank 1 once it has finished this step")
    btr.add_argument("--every", type=positive_int, default=10, help="steps between checkpoints (both systems)")
    btr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="TrainConfig overrides of the benchmark's model (default 28.6 MiB of weights)")
    btr.add_argument("--json", action="store_true")
    btr.set_defaults(fn=cmd_bench_train_recovery)

    sk = bench.add_parser("soak", help="many swarms back to back with kills and corrupt peers; counts crashed daemons")
    sk.add_argument("--swarms", type=int, default=10)
    _swarm_flags(sk, hosts=16, size="32M", rate="8M", chunk="256K", kill=1, corrupt=1)
    sk.set_defaults(fn=cmd_bench_soak)

    bl = bench.add_parser("load", help="model load throughput vs page-cache read of the same files")
    bl.add_argument("--size", type=parse_size, default=parse_size("256M"))
    bl.add_argument("--repeats", type=int, default=3)
    bl.add_argument("--hash", choices=ALGORITHMS, default=mf.HASH_ALGORITHM, help=HASH_HELP)
    bl.add_argument("--engine", choices=("reference", "transformers"), default="reference",
                    help="reference: weightcast's own transformer; transformers: a Hugging Face Llama directory")
    bl.add_argument("--json", action="store_true")
    bl.set_defaults(fn=cmd_bench_load)

    be = bench.add_parser("engine", help="a new version ready in a running engine (verified, golden prompts "
                                         "passed) vs a cold start of that engine, same run")
    be.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    be.add_argument("--json", action="store_true")
    be.set_defaults(fn=cmd_bench_engine)

    bq = bench.add_parser("router", help="time to first token of streamed completions through the router vs the "
                                         "engine called directly, alternating, same run")
    bq.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    bq.add_argument("--requests", type=int, default=200, help="streamed requests on each path")
    bq.add_argument("--json", action="store_true")
    bq.set_defaults(fn=cmd_bench_router)

    br = bench.add_parser("rollout", help="a whole rollout on the embedded stack vs the byte-moving lower bound")
    br.add_argument("--hosts", type=int, default=4)
    br.add_argument("--size", type=parse_size, default=parse_size("64M"))
    br.add_argument("--rate", type=parse_rate, default=parse_rate("16M"))
    br.add_argument("--step-wait", type=float, default=0.0, help="dwell at each traffic step (s)")
    br.add_argument("--json", action="store_true")
    br.set_defaults(fn=cmd_bench_rollout)

    bh = bench.add_parser("rollout-shape", help="a rollout's histories at fleet size (light host activities, the real "
                                                "workflow and dev server): largest payload, longest history, wall time")
    bh.add_argument("--hosts", type=positive_int, default=10_000)
    bh.add_argument("--racks", type=positive_int, default=200)
    bh.add_argument("--max-loads", type=positive_int, default=100, help="the rollout's max_concurrent_loads")
    bh.add_argument("--max-history-events", type=positive_int, default=20_000, help="continue-as-new past this")
    bh.add_argument("--json", action="store_true", help="(the output is always JSON)")
    bh.set_defaults(fn=cmd_bench_rollout_shape)

    gc = sub.add_parser("gpu-check", help="on a CUDA host: verified load to the GPU, both engines in bf16, one "
                                          "rollout; prints JSON (exit 2 without CUDA)")
    gc.set_defaults(fn=cmd_gpu_check)
