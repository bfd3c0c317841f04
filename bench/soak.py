"""`weightcast bench soak`: many real swarms back to back, with kills and corrupt peers, counting daemons
that died on their own (a native crash, an unhandled error). The bar is zero over every swarm."""
from __future__ import annotations

import dataclasses
import time

from bench.swarm import SwarmBenchConfig, run_swarm_bench


async def run_soak(base: SwarmBenchConfig, swarms: int, progress=None) -> dict:
    runs, crashed = [], []
    t0 = time.monotonic()
    for k in range(swarms):
        res = await run_swarm_bench(dataclasses.replace(base, workdir=None))
        runs.append({"swarm": k, "ratio": res["ratio"], "all_verified": res["all_verified"],
                     "crashed": sorted(res["crashed"]), "timed_out": res["timed_out"], "failed": res["failed"],
                     "corrupt_chunks_accepted": res["corrupt_chunks_accepted"]})
        crashed += [{"swarm": k, "host": h, **d} for h, d in res["crashed"].items()]
        if progress:
            progress(k + 1, swarms)
    ratios = sorted(r["ratio"] for r in runs if r["ratio"])
    return {"swarms": swarms, "hosts_per_swarm": base.hosts, "daemons_started": swarms * base.hosts,
            "killed_per_swarm": base.kill, "corrupt_peers_per_swarm": base.corrupt_peers,
            "crashed_daemons": len(crashed), "crashes": crashed,
            "timed_out_swarms": sum(r["timed_out"] for r in runs),
            "unverified_swarms": sum(not r["all_verified"] for r in runs),
            "corrupt_chunks_accepted": sum(r["corrupt_chunks_accepted"] for r in runs),
            "ratio_min": ratios[0] if ratios else None, "ratio_max": ratios[-1] if ratios else None,
            "wall_s": round(time.monotonic() - t0, 1), "runs": runs}
