"""`weightcast bench rollout`: a whole rollout on the embedded stack (real Temporal dev server, peerd
processes, SeaweedFS, model servers, router), timed against the byte-moving lower bound.

- ``rollout_s``: `publish` called → every host ready and traffic at 100 %;
- ``swarm_s``: first peerd job start → last peerd job complete (bytes moving and being verified);
- ``lower_bound_s``: S / R, the time one host's link needs for the checkpoint;
- ``overhead_s``: rollout_s − swarm_s, the time not spent moving bytes (publish, scheduling, loading,
  smoke tests, traffic steps — ``phase_seconds`` breaks it down).
"""
from __future__ import annotations

from weightcast.demo import run_demo


async def run_rollout_bench(hosts: int, size: int, rate: float, step_wait_s: float = 0.0, progress=None) -> dict:
    res = await run_demo(hosts, size, rate, progress=progress, ui=False, step_wait_s=step_wait_s)
    lower = res["bytes"] / rate
    return {"hosts": hosts, "bytes": res["bytes"], "rate": rate, "rollout_s": res["rollout_s"],
            "swarm_s": res["swarm_s"], "lower_bound_s": round(lower, 2),
            "overhead_s": round(res["rollout_s"] - res["swarm_s"], 2),
            "swarm_ratio": round(res["swarm_s"] / lower, 3), "rollout_ratio": round(res["rollout_s"] / lower, 3),
            "publish_s": res["publish_s"], "phase_seconds": res["phase_seconds"],
            "step_wait_s": step_wait_s, "ok": res["ok"]}
