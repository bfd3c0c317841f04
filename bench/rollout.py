"""`weightcast bench rollout`: a whole rollout on the embedded stack (real Temporal dev server, peerd
processes, SeaweedFS, model servers, router), timed against the byte-moving lower bound.

- ``rollout_s``: `publish` called → every host ready and traffic at 100 %;
- ``swarm_s``: first peerd job start → last peerd job complete (bytes moving and being verified);
- ``lower_bound_s``: S / R, the time one host's link needs for the checkpoint;
- ``overhead_s``: rollout_s − swarm_s, the time not spent moving bytes (``phase_seconds`` breaks the
  workflow's part down);
- ``rollout_started_s``: `publish` called → the rollout started (hash, sign, manifest stored);
  ``publish_s``: `publish` called → the last byte stored, while the swarm runs beside it;
- ``storage``: the same checkpoint into the same S3 server, before the rollout, one at a time: a bare
  multipart upload (``bare_multipart_s``, the bound) and weightcast's upload-then-sign publish
  (``publish_alone_s``: read once, hashed from the buffers uploaded, signed), and their ratio;
- ``cpu_s``: CPU seconds the whole stack (every host, the storage, Temporal, this process) spent
  during the rollout; ``cpu_bound_s`` = cpu_s / cores, the least wall time that work needs on this
  machine. Where every host, the storage and the publisher share a few cores, the rollout is bound by
  them (``cpu_ratio`` = rollout_s / cpu_bound_s near 1) before it is bound by the links.
"""
from __future__ import annotations

import dataclasses
import time

from bench.cpu import cores, tree_cpu_seconds
from bench.upload_baseline import bare_multipart
from weightcast.demo import run_demo
from weightcast.publish import upload
from weightcast.stack.seaweed import ACCESS_KEY, SECRET_KEY


async def measure_storage(stack, req) -> dict:
    """Bare multipart, then publish alone, each into a prefix of its own."""
    bare = await bare_multipart(stack.s3.endpoint, stack.s3.bucket, f"{req.origin.prefix}-bare", req.source,
                                ACCESS_KEY, SECRET_KEY, req.chunk_size, req.upload)
    alone = dataclasses.replace(req, origin=dataclasses.replace(req.origin, prefix=f"{req.origin.prefix}-alone"))
    t0 = time.perf_counter()
    await upload(alone)
    took = time.perf_counter() - t0
    return {"bare_multipart_s": round(bare, 2), "publish_alone_s": round(took, 2),
            "publish_ratio": round(took / bare, 3), "part_size": req.upload.part_size,
            "parts_in_flight": req.upload.concurrency}


async def run_rollout_bench(hosts: int, size: int, rate: float, step_wait_s: float = 0.0, progress=None) -> dict:
    res = await run_demo(hosts, size, rate, progress=progress, ui=False, step_wait_s=step_wait_s,
                         before_publish=measure_storage, meter=tree_cpu_seconds)
    lower = res["bytes"] / rate
    cpu_bound = res["metered"] / cores()
    return {"hosts": hosts, "bytes": res["bytes"], "rate": rate, "rollout_s": res["rollout_s"],
            "swarm_s": res["swarm_s"], "lower_bound_s": round(lower, 2),
            "overhead_s": round(res["rollout_s"] - res["swarm_s"], 2),
            "swarm_ratio": round(res["swarm_s"] / lower, 3), "rollout_ratio": round(res["rollout_s"] / lower, 3),
            "rollout_started_s": res["rollout_started_s"], "publish_s": res["publish_s"],
            "phase_seconds": res["phase_seconds"], "storage": res["before_publish"],
            "cpu_s": round(res["metered"], 1), "cores": cores(), "cpu_bound_s": round(cpu_bound, 2),
            "cpu_ratio": round(res["rollout_s"] / cpu_bound, 3),
            "step_wait_s": step_wait_s, "ok": res["ok"]}
