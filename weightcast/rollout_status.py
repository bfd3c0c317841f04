"""Live rollout status for `weightcast rollout status`: the workflow's query plus each host's live
progress, read from the pending activities of the rollout and of its batch children (describe calls,
so live progress costs no history events).

A host is *stuck* when its step is not moving, with the reason: no heartbeat for SILENT_AFTER_S (its
host worker is gone), its activity failing and waiting to be retried (its peerd is down: the error
says so), a load no worker has picked up, or a download that verified nothing for STUCK_AFTER_S.
"""
from __future__ import annotations

import time
from dataclasses import asdict

from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.service import RPCError

from workflows.rollout import RolloutWorkflow

STUCK_AFTER_S = 30.0      # peerd reports, but no chunk verified for this long
SILENT_AFTER_S = 2.5      # no heartbeat for this long (host workers send one a second): the worker is gone or cut off


def _seconds(ts) -> float:
    return ts.ToMicroseconds() / 1e6


def activity_view(pa, details) -> dict:
    """What status shows of one pending activity: attempt, heartbeat age, last error, why it is stuck."""
    now = time.time()
    beat = _seconds(pa.last_heartbeat_time) if pa.HasField("last_heartbeat_time") else None
    started = _seconds(pa.last_started_time) if pa.HasField("last_started_time") else None
    view = {**(details if isinstance(details, dict) else {}), "activity": pa.activity_type.name,
            "attempt": pa.attempt, "heartbeat_age_s": round(now - beat, 1) if beat else None,
            "last_error": pa.last_failure.message or None}
    if pa.HasField("next_attempt_schedule_time"):
        view["next_retry_in_s"] = round(max(0.0, _seconds(pa.next_attempt_schedule_time) - now), 1)
    running = pa.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    silent = now - max(x for x in (beat, started, 0.0) if x is not None)
    if running and silent >= SILENT_AFTER_S:
        view["stuck"] = f"no heartbeat for {silent:.0f} s: its host worker is down or cannot reach Temporal"
    elif not running and pa.attempt > 1 and view["last_error"]:
        view["stuck"] = f"attempt {pa.attempt - 1} failed, retrying: {view['last_error']}"
    elif not running and pa.HasField("scheduled_time") and now - _seconds(pa.scheduled_time) >= SILENT_AFTER_S:
        view["stuck"] = f"not picked up for {now - _seconds(pa.scheduled_time):.0f} s: no host worker is polling"
    elif (view.get("idle_s") or 0) >= STUCK_AFTER_S:
        view["stuck"] = f"no chunk verified for {view['idle_s']:.0f} s"
    return view


async def _pending(client: Client, workflow_id: str) -> list[tuple[object, object]]:
    """(pending activity, its decoded heartbeat details) of one workflow; [] when it is gone."""
    try:
        desc = await client.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return []                   # not started yet, or already gone: its hosts show their state only
    out = []
    for pa in desc.raw_description.pending_activities:
        details = None
        if pa.heartbeat_details.payloads:
            details = (await DataConverter.default.decode(pa.heartbeat_details.payloads))[0]
        out.append((pa, details))
    return out


async def live_status(client: Client, workflow_id: str) -> dict:
    st = await client.get_workflow_handle(workflow_id).query(RolloutWorkflow.status)
    out = asdict(st)
    progress: dict[str, dict] = {}
    if st.phase == "distribute":
        for bid in st.batches:
            for pa, d in await _pending(client, bid):
                if isinstance(d, dict) and "host" in d:
                    progress[d["host"]] = activity_view(pa, d)
                elif pa.activity_id.startswith("distribute-"):      # scheduled, no heartbeat yet
                    progress[pa.activity_id.removeprefix("distribute-")] = activity_view(pa, None)
    loads: dict[str, dict] = {}
    if st.phase in ("load", "traffic", "aborting"):
        for pa, d in await _pending(client, workflow_id):
            if pa.activity_type.name == "load_version" and pa.activity_id.startswith("load "):
                loads[pa.activity_id.removeprefix("load ").rsplit("#", 1)[0]] = activity_view(pa, d)
    live = {h: p for h, p in progress.items() if "bytes_done" in p}
    held = sum(st.held.get(h, 0) for h in live if st.hosts.get(h) not in ("verified", "loading", "ready"))
    bytes_done = st.bytes_done - held + sum(p["bytes_done"] for p in live.values())   # live replaces held
    rate = sum(sum(x["rate_bps"] for x in p.get("peers", [])) for p in live.values())
    remaining = st.bytes_total - bytes_done
    stuck = {h: p["stuck"] for h, p in {**progress, **loads}.items() if p.get("stuck")}
    out.update(bytes_done=bytes_done, progress=progress, loads=loads,
               eta_s=round(remaining / rate, 1) if rate > 0 and remaining > 0 else None, stuck=stuck)
    return out
