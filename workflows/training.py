"""TrainingWorkflow: one durable training run (id ``train-<run>``).

Phases (the ``status`` query): [preflight →] placing → running → (recovering → running)* → exporting
[→ publishing → rolling out] → done. With a rollout the chain is checked before any rank starts (the
publish worker signs a probe, the control worker must trust it and reach the router), and after export
the publish worker uploads and signs the weights and a child RolloutWorkflow rolls them out. The
per-step loop never goes through Temporal: each rank is a process that a ``train_rank`` activity on
its host's queue starts and supervises, heartbeating progress. When any rank fails — its process dies
(``RankFailed``) or its host goes silent (heartbeat timeout) — the workflow cancels the other ranks,
records a ``Recovery`` and starts every rank again from the newest complete checkpoint: on the same
host, or, for a host that went silent, on a spare. Every recovery is in the history with its reason.
"""
from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import (ActivityError, ApplicationError, ChildWorkflowError, TimeoutError,
                                   WorkflowAlreadyStartedError)

with workflow.unsafe.imports_passed_through():
    from workflows.training_types import (ExportInput, PublishedExport, PublishExport, Recovery, RunControl,
                                          TrainingInput, TrainingResult, TrainingStatus, TrainRankInput,
                                          TrainRankResult, rollout_problems)
    from workflows.types import CONTROL_QUEUE, PUBLISH_QUEUE, ManifestRef, PreflightInput, host_queue, rollout_id

ONCE = RetryPolicy(maximum_attempts=1)      # a failed rank is the workflow's decision, not a retry's


@workflow.defn(name="TrainingWorkflow")
class TrainingWorkflow:
    def __init__(self) -> None:
        self._status: TrainingStatus | None = None
        self._run = ""
        self._pause = False
        self._abort: str | None = None
        self._checkpoint_seq = 0
        self._handles: list = []
        self._draining: list = []

    @workflow.query
    def status(self) -> TrainingStatus | None:
        return self._status

    # ---------------------------------------------------------------- operator controls (updates: the
    # caller learns they were applied; the reason, with who asked, is in the history)
    @workflow.update
    async def pause(self, reason: str) -> str:
        """Stop every rank at the next step boundary, after a checkpoint of that step."""
        self._pause = True
        await self._tell_ranks()
        return "pausing at the next step boundary"

    @workflow.update
    async def resume(self, reason: str) -> str:
        self._pause = False     # before the ranks start again, the file says so too
        await self._tell_ranks()
        return "resumed"

    @workflow.update
    async def checkpoint_now(self, reason: str) -> str:
        self._checkpoint_seq += 1
        await self._tell_ranks()
        return f"checkpoint requested (#{self._checkpoint_seq})"

    @workflow.update
    async def abort(self, reason: str) -> str:
        if self._status is not None and self._status.phase in ("publishing", "rolling out"):
            rid = self._status.rollout_id or "its rollout"
            return (f"training is over and its weights are being published or rolled out: abort {rid} itself "
                    "with `weightcast rollout abort`")
        self._abort = reason or "aborted"
        for h in self._handles:
            h.cancel()
        return "aborting"

    async def _tell_ranks(self) -> None:
        st = self._status
        if st is None or not st.ranks:
            return
        await workflow.execute_activity(
            "set_run_control", RunControl(self._run, self._pause, self._checkpoint_seq),
            task_queue=host_queue(st.ranks[0]), start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=5))

    @workflow.run
    async def run(self, inp: TrainingInput) -> TrainingResult:
        world = int(inp.config.get("world_size", 1))
        if len(inp.hosts) < world:
            raise ApplicationError(f"the config needs {world} ranks but only {len(inp.hosts)} hosts were given: "
                                   f"add hosts or lower world_size", type="CannotPlace", non_retryable=True)
        self._run = inp.run
        total = int(inp.config.get("steps", 0))
        tokens = int(inp.config.get("global_batch", 0)) * (int(inp.config.get("seq_len", 1)) - 1)
        st = self._status = TrainingStatus(inp.run, "placing", 0, list(inp.hosts[:world]), list(inp.hosts[world:]),
                                           total, tokens)
        if inp.rollout is not None:
            await self._preflight(inp, st)
            st.phase = "placing"
        while True:
            if self._pause:
                st.phase = "paused"
                await workflow.wait_condition(lambda: not self._pause or self._abort is not None)
            if self._abort is not None:
                st.phase = "aborted"
                raise ApplicationError(f"aborted: {self._abort}", type="Aborted", non_retryable=True)
            st.phase = "running"
            results = await self._attempt(inp, st)
            if results is not None:
                st.resumed_from.append(results[0].first_step)
                st.fetched_checkpoints += [{"attempt": st.attempt, "rank": r.rank, "host": st.ranks[r.rank], **r.fetched}
                                           for r in results if r.fetched]
            if self._abort is not None:
                continue
            if results is not None and results[0].steps >= total:
                break
            if results is not None:             # paused at a step boundary: the next attempt resumes there
                st.attempt += 1
                continue
            if len(st.recoveries) > inp.max_recoveries:
                st.phase = "failed"
                raise ApplicationError(f"gave up after {inp.max_recoveries} recoveries; last: "
                                       f"{st.recoveries[-1].reason}", type="TooManyRecoveries", non_retryable=True)
            st.attempt += 1
        st.final_loss = next((r.held_out_loss for r in results if r.held_out_loss is not None), None)
        if inp.export_dir:
            st.phase = "exporting"
            version = inp.rollout.version if inp.rollout is not None else inp.run     # the weights' own label
            st.export_dir = await workflow.execute_activity(
                "export_weights", ExportInput(inp.run, inp.config, inp.checkpoint_dir, inp.export_dir, version),
                task_queue=host_queue(st.ranks[0]), start_to_close_timeout=timedelta(minutes=30),
                retry_policy=RetryPolicy(maximum_attempts=3))
        await asyncio.gather(*self._draining, return_exceptions=True)
        ready: list[str] = []
        if inp.rollout is not None:
            ready = await self._roll_out(inp, st)
        st.phase = "done"
        return TrainingResult(inp.run, results[0].steps, st.final_loss, st.recoveries, st.export_dir,
                              st.version_id, st.rollout_id, ready)

    def _publish_input(self, inp: TrainingInput, source: str) -> PublishExport:
        r = inp.rollout
        return PublishExport(source, r.model, r.version, r.origin, inp.publish_chunk_size)

    async def _preflight(self, inp: TrainingInput, st: TrainingStatus) -> None:
        """Before any rank starts: can these weights be published and rolled out at the end?"""
        st.phase = "preflight"
        r = inp.rollout
        problems = rollout_problems(inp)
        if not problems:
            try:
                probe = await workflow.execute_activity(
                    "sign_probe", self._publish_input(inp, ""), task_queue=PUBLISH_QUEUE, result_type=str,
                    schedule_to_start_timeout=timedelta(seconds=60), start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=RetryPolicy(maximum_attempts=3), summary="publish worker: sign a probe")
            except ActivityError as e:
                if not isinstance(e.cause, TimeoutError):
                    raise
                problems.append(f"no publish worker answered on {PUBLISH_QUEUE} within 60 s: start "
                                "`python -m workers.publish_worker --key SIGNING.pem` where the signing key lives")
            else:
                problems += await workflow.execute_activity(
                    "preflight", PreflightInput(probe, r.model, r.router, r.previous_version),
                    task_queue=CONTROL_QUEUE, result_type=list[str], start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=RetryPolicy(maximum_attempts=2), summary="rollout pre-checks: signing key, router")
        if problems:
            st.phase = "failed"
            raise ApplicationError("the trained weights could not be rolled out, so training was not started: "
                                   + "; ".join(problems), type="CannotRollOut", non_retryable=True)

    async def _roll_out(self, inp: TrainingInput, st: TrainingStatus) -> list[str]:
        """Publish the export (upload, sign) and roll it out as a child workflow; the hosts now serving it."""
        r = inp.rollout
        st.phase = "publishing"
        pub: PublishedExport = await workflow.execute_activity(
            "publish_export", self._publish_input(inp, st.export_dir), task_queue=PUBLISH_QUEUE,
            result_type=PublishedExport, start_to_close_timeout=timedelta(hours=12),
            heartbeat_timeout=timedelta(seconds=60), retry_policy=RetryPolicy(maximum_attempts=5),
            summary=f"publish {r.model}/{r.version}")
        st.version_id = pub.version_id
        st.phase = "rolling out"
        st.rollout_id = rollout_id(r.model, r.version)
        try:
            # abandoned, not cancelled, with the parent: a rollout is steered on its own (pause, abort)
            result = await workflow.execute_child_workflow(
                "RolloutWorkflow", dataclasses.replace(r, manifest=ManifestRef(pub.version_id, pub.key)),
                id=st.rollout_id, task_queue=CONTROL_QUEUE, result_type=dict,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
        except WorkflowAlreadyStartedError:
            st.detail = f"{st.rollout_id} already exists (started by someone else): not started again"
            return []
        except ChildWorkflowError as e:
            st.phase = "failed"
            raise ApplicationError(f"training finished and {r.model}/{r.version} was published, but its rollout "
                                   f"{st.rollout_id} failed: {e.cause or e}", type="RolloutFailed",
                                   non_retryable=True) from None
        return list(result.get("ready", []))

    @staticmethod
    def _shrunk(inp: TrainingInput, ranks: list[str], failed: int) -> tuple[list[str], list[str]] | None:
        """The ranks (and the surplus) to go on with after losing ``failed``, or None to wait for it:
        the largest data-parallel degree of at least min_world_size that divides the global batch."""
        if not inp.min_world_size or inp.config.get("layout", "ddp") != "ddp":
            return None
        survivors = [h for i, h in enumerate(ranks) if i != failed]
        batch = int(inp.config.get("global_batch", 1))
        fits = [w for w in range(len(survivors), 0, -1) if batch % w == 0 and w >= inp.min_world_size]
        return (survivors[:fits[0]], survivors[fits[0]:]) if fits else None

    async def _attempt(self, inp: TrainingInput, st: TrainingStatus) -> list[TrainRankResult] | None:
        """One attempt of every rank; None after recording how to recover from its failure."""
        init = await workflow.execute_activity("rendezvous", inp.run, task_queue=host_queue(st.ranks[0]),
                                               start_to_close_timeout=timedelta(seconds=30),
                                               retry_policy=RetryPolicy(maximum_attempts=5))
        config = dict(inp.config, world_size=len(st.ranks))      # fewer after a shrink
        handles = self._handles = [workflow.start_activity(
            "train_rank", TrainRankInput(inp.run, r, config, init, st.attempt, inp.checkpoint_dir,
                                         inp.checkpoint_every, inp.collective_timeout_s, inp.checkpoint_archive,
                                         inp.checkpoint_every_s),
            result_type=TrainRankResult, task_queue=host_queue(host),
            start_to_close_timeout=timedelta(seconds=inp.run_timeout_s),
            # a host whose worker never picks the rank up is as lost as one that stops heartbeating
            schedule_to_start_timeout=timedelta(seconds=max(60.0, 3 * inp.heartbeat_timeout_s)),
            heartbeat_timeout=timedelta(seconds=inp.heartbeat_timeout_s), retry_policy=ONCE)
            for r, host in enumerate(st.ranks)]
        try:
            return list(await asyncio.gather(*handles))
        except ActivityError as e:
            first = e                             # the first rank to fail, in time
            if self._abort is not None:           # our own cancellation: no recovery to record
                await asyncio.gather(*handles, return_exceptions=True)
                return None
        if workflow.patched("silent-host-is-the-cause"):
            # a rank whose peer's machine died fails at once (its collective breaks: it exits with an
            # error) while the dead host's own rank is only known lost when its heartbeats time out:
            # then wait that long, so the silent host, not the survivor, is the cause (and its rank
            # migrates instead of being restarted where nothing answers). A rank killed by a signal or
            # a silent host is the cause itself: no wait.
            if _exited_with_error(first):
                try:
                    await workflow.wait_condition(lambda: all(h.done() for h in handles),
                                                  timeout=timedelta(seconds=inp.heartbeat_timeout_s + 2))
                except asyncio.TimeoutError:
                    pass
            # the cause: a silent host if any, else a rank killed by a signal (its peers' collectives
            # break at once and may be reported first), else the first rank to fail; the others fail
            # because it did. Only the recovery's record depends on which: every rank restarts alike
            failures = [i for i, h in enumerate(handles) if h.done() and not h.cancelled() and h.exception() is not None]
            failed = next((i for i in failures if isinstance(handles[i].exception().__cause__, TimeoutError)),
                          next((i for i in failures if _killed_by_signal(handles[i].exception())),
                               next(i for i in failures if handles[i].exception() is first)))
        else:                                     # histories recorded before the patch
            failed = next(i for i, h in enumerate(handles) if h.done() and h.exception() is not None)
        for h in handles:
            h.cancel()
        # the next attempt starts now: the cancelled ranks stop on their own (their peer is gone, and the
        # cancellation kills their process), on a fresh rendezvous; they are awaited at the end
        self._draining += [h for h in handles if not h.done()]
        err = handles[failed].exception()
        host = st.ranks[failed]
        silent = isinstance(err.__cause__, TimeoutError)
        shrunk = self._shrunk(inp, st.ranks, failed) if silent and not st.spares else None
        if silent and st.spares:
            st.ranks[failed] = st.spares.pop(0)
            action = f"migrate to {st.ranks[failed]}"
        elif shrunk is not None:
            st.ranks, surplus = shrunk
            st.spares += surplus
            n = len(st.ranks)
            action = f"shrink to {n} rank{'s' if n != 1 else ''}" + (f" ({', '.join(surplus)} now spare)" if surplus else "")
        else:
            action = f"restart on {host}"
        reason = "host silent (heartbeat timeout)" if silent else str(err.__cause__ or err)
        st.recoveries.append(Recovery(st.attempt, failed, host, reason, action, workflow.now().isoformat()))
        st.phase = "recovering"
        workflow.logger.warning("training rank failed: %s; %s", reason, action)
        return None


def _exited_with_error(err: ActivityError) -> bool:
    """A rank process that ended with an error status (not killed by a signal, not a silent host)."""
    cause = err.__cause__
    return isinstance(cause, ApplicationError) and cause.type == "RankFailed" and not _killed_by_signal(err)


def _killed_by_signal(err: ActivityError) -> bool:
    cause = err.__cause__
    return (isinstance(cause, ApplicationError) and cause.type == "RankFailed" and bool(cause.details)
            and isinstance(cause.details[0], dict) and bool(cause.details[0].get("signal")))
