"""PreflightWorkflow: `weightcast publish` asks the control worker, the one that will check the real
manifest, whether a rollout could succeed before a byte is uploaded (the key, the router)."""
from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.types import CONTROL_QUEUE, PreflightInput


@workflow.defn
class PreflightWorkflow:
    @workflow.run
    async def run(self, inp: PreflightInput) -> list[str]:
        return await workflow.execute_activity(
            "preflight", inp, task_queue=CONTROL_QUEUE, result_type=list[str],
            start_to_close_timeout=timedelta(seconds=30), retry_policy=RetryPolicy(maximum_attempts=2),
            summary="publish pre-checks: signing key, router")
