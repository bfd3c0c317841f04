"""Live rollout status for `weightcast rollout status`: the workflow's query plus each downloading
host's progress, read from the heartbeat details of the batch children's pending activities
(describe calls, so live progress costs no history events)."""
from __future__ import annotations

import time
from dataclasses import asdict

from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.service import RPCError

from workflows.rollout import RolloutWorkflow

STUCK_AFTER_S = 30.0      # peerd reports, but no chunk verified for this long
SILENT_AFTER_S = 6.0      # no heartbeat for this long (host workers send one a second): peerd or the worker is gone


async def live_status(client: Client, workflow_id: str) -> dict:
    h = client.get_workflow_handle(workflow_id)
    st = await h.query(RolloutWorkflow.status)
    out = asdict(st)
    progress: dict[str, dict] = {}
    if st.phase == "distribute":
        for bid in st.batches:
            try:
                desc = await client.get_workflow_handle(bid).describe()
            except RPCError:
                continue            # not started yet, or already gone: its hosts show their state only
            for pa in desc.raw_description.pending_activities:
                if not pa.heartbeat_details.payloads:
                    continue
                d = (await DataConverter.default.decode(pa.heartbeat_details.payloads))[0]
                if isinstance(d, dict) and "host" in d:
                    beat = pa.last_heartbeat_time.ToMicroseconds() / 1e6 if pa.HasField("last_heartbeat_time") else None
                    progress[d["host"]] = {**d, "attempt": pa.attempt,
                                           "heartbeat_age_s": round(time.time() - beat, 1) if beat else None,
                                           "last_error": pa.last_failure.message or None}
    bytes_done = st.bytes_done + sum(p["bytes_done"] for p in progress.values())   # finished hosts + live ones
    rate = sum(sum(x["rate_bps"] for x in p["peers"]) for p in progress.values())
    remaining = st.bytes_total - bytes_done
    out.update(bytes_done=bytes_done, progress=progress,
               eta_s=round(remaining / rate, 1) if rate > 0 and remaining > 0 else None,
               stuck=sorted(h for h, p in progress.items() if p["idle_s"] >= STUCK_AFTER_S
                            or (p["heartbeat_age_s"] or 0) >= SILENT_AFTER_S))
    return out
