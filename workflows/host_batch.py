"""One child workflow per batch of hosts: distribution (with verification) on each host's queue."""
from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutError as TemporalTimeout, TimeoutType

with workflow.unsafe.imports_passed_through():
    from workflows.types import DistributeResult, HostBatchInput, HostOutcome, HostSpec


@workflow.defn
class HostBatchWorkflow:
    @workflow.run
    async def run(self, inp: HostBatchInput) -> list[HostOutcome]:
        return list(await asyncio.gather(*(self._one(h, inp) for h in inp.hosts)))

    async def _one(self, spec: HostSpec, inp: HostBatchInput) -> HostOutcome:
        host = spec.id
        try:
            res: DistributeResult = await workflow.execute_activity(
                "distribute", inp.distribute, task_queue=spec.queue, result_type=DistributeResult,
                schedule_to_start_timeout=timedelta(seconds=inp.unreachable_after_s),
                start_to_close_timeout=timedelta(hours=12),
                heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10),
                summary=f"distribute to {host}")
            return HostOutcome(host, "verified", bytes_total=res.bytes_total, seconds=res.seconds)
        except ActivityError as e:
            cause = e.cause
            if isinstance(cause, TemporalTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START:
                return HostOutcome(host, "unreachable", f"no worker polled {spec.queue}")
            return HostOutcome(host, "failed", str(cause or e))
