"""Starting and finding rollouts: one workflow per (model, version), never two by accident."""
from __future__ import annotations

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, RolloutInput


class InvalidRolloutInput(ValueError):
    """The rollout was not started: the message lists every problem with the input."""


def check_input(inp: RolloutInput, what: str = "rollout not started") -> None:
    """Raise InvalidRolloutInput listing every problem with ``inp`` (nothing when it is valid)."""
    problems = inp.problems()
    if problems:
        raise InvalidRolloutInput(f"{what}: " + "; ".join(problems))


def rollout_id(model: str, version: str) -> str:
    return f"rollout-{model}-{version}"


async def start_rollout(client: Client, inp: RolloutInput, workflow_id: str | None = None) -> WorkflowHandle:
    """Idempotent: a retried CI job attaches to the running rollout (USE_EXISTING); a finished one is
    never started again under the same id (REJECT_DUPLICATE) — roll out a new version instead.
    Bad input is refused here, before anything reaches Temporal (the workflow checks again)."""
    check_input(inp)
    return await client.start_workflow(
        RolloutWorkflow.run, inp, id=workflow_id or rollout_id(inp.model, inp.version), task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
