"""Start and read durable training runs (TrainingWorkflow) from the CLI or CI."""
from __future__ import annotations

import dataclasses
import re
import time

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.converter import DataConverter
from temporalio.service import RPCError, RPCStatusCode

from training.config import ConfigError, TrainConfig
from workflows.training import TrainingWorkflow
from workflows.training_types import TrainingInput, rollout_problems
from workflows.types import CONTROL_QUEUE

DURABLE_LAYOUTS = ("single", "ddp", "fsdp", "tp", "fsdp_tp")     # pp: its stages' state is not checkpointed yet
RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def training_id(run: str) -> str:
    return f"train-{run}"


class UnknownRun(LookupError):
    pass


async def find_run(client: Client, name: str) -> str:
    """The run that ``name`` names: a run name (``t1``) or its workflow id (``train-t1``, what `train
    start` prints). A run whose own name starts with ``train-`` wins over the id reading."""
    candidates = [name] + ([name.removeprefix("train-")] if name.startswith("train-") else [])
    for run in candidates:
        try:
            await client.get_workflow_handle(training_id(run)).describe()
            return run
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
    raise UnknownRun(f"no training run {name!r} (looked for workflow ids "
                     f"{', '.join(training_id(r) for r in candidates)})")


def check_training(inp: TrainingInput) -> None:
    """Refuse, before anything starts, a run that cannot be placed or configured."""
    if not RUN.match(inp.run):
        raise ConfigError(f"run name {inp.run!r}: letters, digits, . _ - (at most 100)")
    cfg = TrainConfig.from_dict(inp.config)
    cfg.check()
    if len(inp.hosts) < cfg.world_size:
        raise ConfigError(f"the config needs {cfg.world_size} ranks but only {len(inp.hosts)} hosts were given "
                          f"({', '.join(inp.hosts) or 'none'}): add hosts or lower world_size")
    if len(set(inp.hosts)) != len(inp.hosts):
        raise ConfigError("a host is listed twice: one rank per host")
    if cfg.layout not in DURABLE_LAYOUTS:
        raise ConfigError(f"durable runs support layouts {', '.join(DURABLE_LAYOUTS)} for now, not {cfg.layout!r}")
    if not 0 <= inp.min_world_size <= cfg.world_size:
        raise ConfigError(f"min_world_size {inp.min_world_size} must be in [0, world_size {cfg.world_size}] "
                          "(0: never shrink, wait for a lost host)")
    if inp.min_world_size and cfg.layout != "ddp":
        raise ConfigError("shrinking on host loss (min_world_size) needs layout ddp")
    if inp.checkpoint_every < 1:
        raise ConfigError("checkpoint_every must be at least 1 step")
    if not inp.checkpoint_every_s >= 0:
        raise ConfigError("checkpoint_every_s is seconds between time-based checkpoints, >= 0 (0: by steps only)")
    problems = rollout_problems(inp)
    if problems:
        raise ConfigError("training not started, its rollout would be refused: " + "; ".join(problems))


async def start_training(client: Client, inp: TrainingInput) -> WorkflowHandle:
    """Idempotent like rollouts: a retried CI job attaches to the running run; a finished run's id is not reused."""
    check_training(inp)
    return await client.start_workflow(
        TrainingWorkflow.run, inp, id=training_id(inp.run), task_queue=CONTROL_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)


async def training_status(client: Client, run: str) -> dict:
    """The workflow's view (phase, ranks, recoveries) joined with the ranks' live heartbeats (step,
    loss, step time, last complete checkpoint) and an ETA."""
    h = client.get_workflow_handle(training_id(run))
    desc = await h.describe()
    st = await h.query(TrainingWorkflow.status)
    ranks = {}
    for pa in desc.raw_description.pending_activities:
        if pa.activity_type.name != "train_rank" or not pa.heartbeat_details.payloads:
            continue
        d = (await DataConverter.default.decode(pa.heartbeat_details.payloads))[0]
        d["heartbeat_age_s"] = round(time.time() - pa.last_heartbeat_time.ToSeconds(), 1)
        ranks[pa.activity_id] = d
    out = {"run": run, "status": desc.status.name, **(dataclasses.asdict(st) if st else {}), "live": ranks}
    steps = [r["step"] for r in ranks.values() if r.get("step") is not None]
    step_s = max((r["step_s"] for r in ranks.values() if r.get("step_s")), default=None)   # the slowest rank
    out["step"] = min(steps) if steps else None
    out["loss"] = next((r["loss"] for r in ranks.values() if r.get("loss") is not None), None)
    out["last_checkpoint"] = max((r["last_checkpoint"] for r in ranks.values() if r.get("last_checkpoint")),
                                 default=None)
    out["step_s"] = step_s
    out["tokens_per_s"] = round(st.tokens_per_step / step_s) if st and step_s else None
    for key in ("mfu", "comm_fraction"):           # the ranks' mean (each against its own host's peak)
        vals = [r[key] for r in ranks.values() if r.get(key) is not None]
        out[key] = round(sum(vals) / len(vals), 4) if vals else None
    out["eta_s"] = (round((st.total_steps - out["step"]) * step_s, 1)
                    if st and step_s and out["step"] is not None else None)
    return out
