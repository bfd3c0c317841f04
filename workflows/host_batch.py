"""One child workflow per batch of hosts: distribution (with verification) on each host's queue.

A stoppable batch (``HostBatchInput.stoppable``) ends early on the ``stop`` signal: each host's
download is cancelled, its activity stops peerd's job and answers with the verified bytes it keeps,
and the batch returns those hosts as ``stopped``. The parent sends it on pause and abort.
"""
from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutError as TemporalTimeout, TimeoutType
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from workflows.types import DistributeResult, HostBatchInput, HostOutcome, HostSpec, HostState

STOP_ACK_S = 2.0     # how long a stopped host may take to say what it kept (a dead worker never does)


@workflow.defn
class HostBatchWorkflow:
    def __init__(self) -> None:
        self.stopping = False

    @workflow.signal
    def stop(self) -> None:
        self.stopping = True

    @workflow.run
    async def run(self, inp: HostBatchInput) -> list[HostOutcome]:
        one = self._stoppable if inp.stoppable else self._one
        return list(await asyncio.gather(*(one(h, inp) for h in inp.hosts)))

    def _distribute(self, spec: HostSpec, inp: HostBatchInput, **kw):
        return workflow.start_activity(
            "distribute", inp.distribute, task_queue=spec.queue, result_type=DistributeResult,
            schedule_to_start_timeout=timedelta(seconds=inp.unreachable_after_s),
            start_to_close_timeout=timedelta(hours=12),
            heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10),
            summary=f"distribute to {spec.id}", **kw)

    async def _one(self, spec: HostSpec, inp: HostBatchInput) -> HostOutcome:
        try:
            res: DistributeResult = await self._distribute(spec, inp)
            return HostOutcome(spec.id, HostState.VERIFIED, bytes_total=res.bytes_total, seconds=res.seconds)
        except ActivityError as e:
            return _failed(spec, e)

    async def _stoppable(self, spec: HostSpec, inp: HostBatchInput) -> HostOutcome:
        act = self._distribute(spec, inp, cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                               activity_id=f"distribute-{spec.id}")     # status names a host not yet started
        await workflow.wait_condition(lambda: act.done() or self.stopping)
        if not act.done():
            act.cancel()
            try:
                await workflow.wait_condition(act.done, timeout=timedelta(seconds=STOP_ACK_S))
            except asyncio.TimeoutError:
                return HostOutcome(spec.id, HostState.STOPPED, f"did not confirm the stop within {STOP_ACK_S:g} s")
        try:
            res: DistributeResult = act.result()
        except ActivityError as e:
            if self.stopping:          # cancelled by a host that says nothing of what it kept
                return HostOutcome(spec.id, HostState.STOPPED, str(e.cause or e))
            return _failed(spec, e)
        if res.stopped:
            return HostOutcome(spec.id, HostState.STOPPED, bytes_total=res.bytes_total, bytes_held=res.bytes_held)
        return HostOutcome(spec.id, HostState.VERIFIED, bytes_total=res.bytes_total, seconds=res.seconds)


def _failed(spec: HostSpec, e: ActivityError) -> HostOutcome:
    cause = e.cause
    if isinstance(cause, TemporalTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START:
        return HostOutcome(spec.id, HostState.UNREACHABLE, f"no worker polled {spec.queue}")
    return HostOutcome(spec.id, HostState.FAILED, str(cause or e))
