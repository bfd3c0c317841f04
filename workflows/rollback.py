"""RollbackWorkflow: `weightcast rollout rollback MODEL` moves all traffic back to an earlier version
through the same durable machinery as a rollout's traffic steps (the router refuses a version without
ready capacity; a refusal that outlasts the retries ends the workflow failed, visibly)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.types import CONTROL_QUEUE, TrafficInput


@dataclass
class RollbackInput:
    model: str
    router: str
    to_version: str
    from_version: str = ""           # the version traffic leaves (for the record)
    reason: str = ""


@workflow.defn
class RollbackWorkflow:
    @workflow.run
    async def run(self, inp: RollbackInput) -> dict:
        workflow.set_current_details(f"**rollback** {inp.model}: {inp.from_version or '?'} → {inp.to_version} "
                                     f"({inp.reason or 'no reason given'})")
        result = await workflow.execute_activity(
            "set_traffic", TrafficInput(inp.router, inp.model, {inp.to_version: 100}, {}, [inp.to_version]),
            task_queue=CONTROL_QUEUE, start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10),
            summary=f"traffic {inp.to_version}: 100%")
        return {"model": inp.model, "traffic": {inp.to_version: 100}, "from": inp.from_version,
                "reason": inp.reason, "router": result}
