"""Shared by the durable-training tests: a tiny run's config, host-worker processes, rank progress."""
import asyncio
import json
from pathlib import Path

from tests.fleet import TOKEN
from weightcast.stack.module_proc import ModuleProc

CONFIG = ["model.vocab=128", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.max_seq=16",
          "seq_len=16", "global_batch=8", "lr=3e-2", "layout=ddp", "world_size=2", "steps=40"]


async def hosts(env, root: Path, ids, s3_env: dict | None = None, fleet=None,
                metrics: dict[str, int] | None = None, spares=()) -> dict[str, ModuleProc]:
    """Host-worker processes; with ``fleet`` (tests/fleet.Fleet) each drives its host's peerd; with
    ``metrics`` ({host: port}) each serves its Prometheus metrics there. ``spares`` do not preload
    torch: their fork server starts with the first rank they are given, if any."""
    target = env.client.service_client.config.target_host

    def peerd(i: str) -> list[str]:             # the fleet's stores are root/<id>/store too
        return ["--peerd", fleet.procs[i].addr] if fleet else []
    procs = {i: ModuleProc(f"host-worker {i}", "workers.host_worker", root / i,
                           ["--id", i, "--temporal", target, "--namespace", env.client.namespace, "--store", str(root / i / "store"),
                            "--train-dir", str(root / i / "train"), "--heartbeat-every", "0.5", *peerd(i),
                            *(["--metrics-port", str(metrics[i])] if metrics else []),
                            *(["--no-preload-training"] if i in spares else [])],
                           env={**(s3_env or {}), "WEIGHTCAST_TOKEN": TOKEN}).launch()
             for i in ids}
    for p in procs.values():
        await asyncio.to_thread(p.wait_ready)
    return procs


def progress(root: Path, host: str, rank: int) -> dict:
    """The newest attempt's progress of a rank on a host (what its activity heartbeats)."""
    for f in sorted((root / host / "train").glob(f"*/attempt-*/rank{rank}/progress.json"), reverse=True):
        try:
            return json.loads(f.read_text())
        except ValueError:
            pass
    return {}
