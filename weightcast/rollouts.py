"""Starting and finding rollouts: one workflow per (model, version), never two by accident."""
from __future__ import annotations

import uuid

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from workflows.rollback import RollbackInput, RollbackWorkflow
from workflows.rollout import RolloutWorkflow
from workflows.types import CONTROL_QUEUE, NAME, RolloutInput, rollout_id


class InvalidRolloutInput(ValueError):
    """The rollout was not started: the message lists every problem with the input."""


def check_input(inp: RolloutInput, what: str = "rollout not started") -> None:
    """Raise InvalidRolloutInput listing every problem with ``inp`` (nothing when it is valid)."""
    problems = inp.problems()
    if problems:
        raise InvalidRolloutInput(f"{what}: " + "; ".join(problems))


async def start_rollout(client: Client, inp: RolloutInput, workflow_id: str | None = None) -> WorkflowHandle:
    """Idempotent: a retried CI job attaches to the running rollout (USE_EXISTING); a finished one is
    never started again under the same id (REJECT_DUPLICATE) — roll out a new version instead.
    Bad input is refused here, before anything reaches Temporal (the workflow checks again)."""
    check_input(inp)
    return await client.start_workflow(
        RolloutWorkflow.run, inp, id=workflow_id or rollout_id(inp.model, inp.version), task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)


async def latest_completed_rollout(client: Client, model: str) -> RolloutInput | None:
    """The input of the most recently closed, completed rollout of ``model`` (visibility, then the
    first event of its history)."""
    if not NAME.match(model):
        raise InvalidRolloutInput(f"model {model!r} is not a model name (letters, digits, . _ -)")
    latest = None
    query = (f"WorkflowType = 'RolloutWorkflow' AND ExecutionStatus = 'Completed' "
             f"AND WorkflowId STARTS_WITH '{rollout_id(model, '')}'")      # only this model's rollouts
    async for w in client.list_workflows(query):
        if latest is None or w.close_time > latest.close_time:
            latest = w
    if latest is None:
        return None
    hist = await client.get_workflow_handle(latest.id, run_id=latest.run_id).fetch_history()
    started = hist.events[0].workflow_execution_started_event_attributes
    [inp] = await client.data_converter.decode(started.input.payloads, [RolloutInput])
    return inp


async def rollback(client: Client, model: str, to_version: str = "", reason: str = "") -> dict:
    """Move all of ``model``'s traffic back to ``to_version`` (default: the version the last completed
    rollout replaced) through RollbackWorkflow. Raises InvalidRolloutInput when there is nothing to
    roll back to."""
    last = await latest_completed_rollout(client, model)
    if last is None or not last.router:
        raise InvalidRolloutInput(f"no completed rollout of {model!r} with a router: nothing to roll back")
    to = to_version or last.previous_version
    if not to:
        raise InvalidRolloutInput(f"the last rollout of {model!r} ({last.version}) replaced no previous version; "
                                  "say which version to return to with --to")
    if to == last.version:
        raise InvalidRolloutInput(f"{to} is the version the last rollout installed; roll back to an earlier one")
    wid = f"rollback-{model}-{to}-{uuid.uuid4().hex[:6]}"
    result = await client.execute_workflow(
        RollbackWorkflow.run, RollbackInput(model, last.router, to, last.version, reason), id=wid,
        task_queue=CONTROL_QUEUE)
    return {"workflow_id": wid, **result}
