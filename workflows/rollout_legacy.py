"""RolloutWorkflow's run as it was before the ``controls-preempt-retries`` patch, kept only so that
histories recorded before it replay (tests/histories). Every rollout started since takes the paths in
workflows/rollout.py. Delete this file, and the branch that calls it, once no such rollout can still
be running and the histories are re-recorded (retiring the patch: ``workflow.deprecate_patch``)."""
from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from peerd.seeders import MAX_SEEDERS, seeders_across_racks
    from workflows.host_batch import HostBatchWorkflow
    from workflows.types import (CONTROL_QUEUE, AnalysisInput, AnalysisResult, DiscardInput, DistributeInput,
                                 HostBatchInput, HostOutcome, LoadInput, ManifestCheck, ManifestInfo, RolloutCarry,
                                 RolloutInput, TrafficInput)

MAX_PENDING_LOADS = 1000      # Temporal allows 2,000 pending activities per workflow


class LegacyRolloutPaths:
    """Mixed into RolloutWorkflow: its state, ``_set_phase``, ``_checkpoint`` and ``_budget`` are shared."""

    async def _v1_entry(self, inp: RolloutInput) -> dict:
        # histories recorded before this patch checked pause/abort only between phases
        self.controls_act_now = workflow.patched("controls-act-now")
        try:
            if inp.carry:
                return await self._v1_resume(inp, inp.carry)
            return await self._v1_run(inp)
        except ApplicationError as e:
            failure = await self._v1_after_abort(inp, e) if e.type == "Aborted" else None
            self._set_phase("failed", str(failure or e))
            if failure:
                raise failure from None
            raise

    async def _v1_after_abort(self, inp: RolloutInput, e: ApplicationError) -> ApplicationError | None:
        """Traffic back to the previous version, then the aborted version taken off every host. Returns
        the error to end with when moving traffic back failed (the workflow still ends failed, saying so)."""
        if inp.router and inp.previous_version:
            if not self.controls_act_now:
                await self._v1_traffic(inp, {inp.previous_version: 100}, [])   # histories before the patch
                return None
            try:
                await self._v1_traffic(inp, {inp.previous_version: 100}, [])
            except ActivityError as te:
                return ApplicationError(f"{e.message}; AND moving traffic back to {inp.previous_version} failed: "
                                        f"{te.cause or te}", type="RollbackFailed", non_retryable=True)
        if not self.controls_act_now or not self.version_id:
            return None
        if self.traffic.get(inp.version):
            # no previous version to move its traffic to: it keeps serving, so it stays where it is
            self._set_phase("aborting", f"{inp.version} still carries {self.traffic[inp.version]}% of traffic "
                                        "(no previous version to return to): left loaded and stored")
            return None
        self._set_phase("aborting", f"removing {inp.version} from {len(inp.hosts)} hosts")
        results = await asyncio.gather(*(workflow.execute_activity(
            "discard_version", DiscardInput(inp.version, self.version_id), task_queue=h.queue,
            schedule_to_start_timeout=timedelta(seconds=inp.unreachable_after_s),
            start_to_close_timeout=timedelta(seconds=120), retry_policy=RetryPolicy(maximum_attempts=3),
            summary=f"discard {inp.version} on {h.id}") for h in inp.hosts), return_exceptions=True)
        for h, r in zip(inp.hosts, results):
            if isinstance(r, BaseException):
                self.errors[h.id] = f"could not remove the aborted version: {getattr(r, 'cause', None) or r}"
            elif self.hosts.get(h.id) not in ("failed", "unreachable"):
                self.hosts[h.id] = "discarded"
        return None

    async def _v1_run(self, inp: RolloutInput) -> dict:
        self._set_phase("manifest", "checking the signature")
        try:
            if inp.manifest is not None:   # by reference: the activity fetches it and checks digest and signature
                info: ManifestInfo = await workflow.execute_activity(
                    "check_manifest_ref", ManifestCheck(inp.manifest, inp.origin), task_queue=CONTROL_QUEUE,
                    result_type=ManifestInfo, start_to_close_timeout=timedelta(minutes=5),
                    retry_policy=RetryPolicy(maximum_attempts=5), summary="fetch and verify the signed manifest")
            else:
                info = await workflow.execute_activity(
                    "check_manifest", inp.signed_manifest, task_queue=CONTROL_QUEUE, result_type=ManifestInfo,
                    start_to_close_timeout=timedelta(minutes=5), summary="verify manifest signature")
        except ActivityError as e:
            raise ApplicationError(f"manifest refused, nothing loaded: {e.cause}", type="ManifestRefused",
                                   non_retryable=True) from None
        if (info.model, info.version) != (inp.model, inp.version):
            raise ApplicationError(f"manifest is {info.model}/{info.version}, rollout is {inp.model}/{inp.version}",
                                   non_retryable=True)
        self.bytes_total, self.version_id = info.bytes_total, info.version_id

        await self._checkpoint()
        self._set_phase("distribute", f"{len(inp.hosts)} hosts, {info.bytes_total} bytes")
        for h in self.hosts:
            self.hosts[h] = "downloading"
        seeders = seeders_across_racks([(h.id, h.rack) for h in inp.hosts], MAX_SEEDERS)
        dist = DistributeInput(inp.signed_manifest, inp.origin, seeders, inp.manifest)
        batches = [inp.hosts[i:i + inp.batch_size] for i in range(0, len(inp.hosts), inp.batch_size)]
        if self.controls_act_now:
            results = await self._v1_distribute_until_stopped(inp, dist, batches)
        else:
            results = await self._v1_batch_children(inp, dist, batches)
        for outcome in (o for batch in results for o in batch):
            self.hosts[outcome.host] = outcome.state
            if outcome.error:
                self.errors[outcome.host] = outcome.error
        await self._budget(inp)

        self._set_phase("verify", "every chunk was checked against the signed manifest on arrival")
        await self._checkpoint()
        self._set_phase("load", f"at most {self.max_loads} hosts at a time")
        return await self._v1_load_and_shift(inp, info)

    async def _v1_distribute_until_stopped(self, inp: RolloutInput, dist: DistributeInput,
                                        batches: list[list]) -> list[list[HostOutcome]]:
        """The batch children, stopped the moment a pause or an abort arrives: cancelling a child cancels
        its distribute activities, which stop peerd's downloads (verified chunks stay). On resume the
        children start again (new ids) and every host continues from its bitmap."""
        attempt = 0
        while True:
            suffix = "" if attempt == 0 else f"-r{attempt}"
            run = asyncio.ensure_future(self._v1_batch_children(inp, dist, batches, suffix))
            await workflow.wait_condition(lambda: run.done() or self.paused or bool(self.abort_reason))
            if run.done():
                return run.result()
            run.cancel()
            try:
                await run
            except (asyncio.CancelledError, ChildWorkflowError):
                pass                                    # the children acknowledged the cancellation
            if not self.abort_reason:
                for h in self.hosts:
                    self.hosts[h] = "paused"
                self._set_phase("distribute", "PAUSED: downloads stopped, verified chunks kept; resume or abort")
            await self._checkpoint()
            self._set_phase("distribute", f"resumed: {len(inp.hosts)} hosts continue from their bitmaps")
            for h in self.hosts:
                self.hosts[h] = "downloading"
            attempt += 1

    def _v1_batch_children(self, inp: RolloutInput, dist: DistributeInput, batches: list[list], suffix: str = ""):
        """One HostBatchWorkflow child per batch (ids ``<workflow id>-batch-<i><suffix>``), gathered."""
        self.batches = [f"{workflow.info().workflow_id}-batch-{i}{suffix}" for i in range(len(batches))]
        return asyncio.gather(*(
            workflow.execute_child_workflow(
                HostBatchWorkflow.run, HostBatchInput(b, dist, inp.unreachable_after_s, inp.heartbeat_timeout_s),
                id=self.batches[i], result_type=list[HostOutcome])
            for i, b in enumerate(batches)))

    async def _v1_unless_aborted(self, seconds: float) -> None:
        """A timer that an abort ends early."""
        try:
            await workflow.wait_condition(lambda: bool(self.abort_reason), timeout=timedelta(seconds=seconds))
        except asyncio.TimeoutError:
            pass

    async def _v1_resume(self, inp: RolloutInput, c: RolloutCarry) -> dict:
        """A continued-as-new run: restore the state and carry on loading."""
        self._restore(c)
        return await self._v1_load_and_shift(inp, c.info)

    async def _v1_load_and_shift(self, inp: RolloutInput, info: ManifestInfo) -> dict:
        if not await self._v1_load_all(inp, info):
            await self._continue_as_new(inp, info)
        await self._budget(inp)
        ready = [h for h, s in self.hosts.items() if s == "ready"]

        if inp.router:
            for step in inp.traffic_steps:
                await self._checkpoint()
                self._set_phase("traffic", f"{step}% to {inp.version}")
                weights = {inp.version: step}
                if inp.previous_version and step < 100:
                    weights[inp.previous_version] = 100 - step
                await self._v1_traffic(inp, weights, ready)
                if inp.analysis is not None and step < 100:
                    await self._v1_analyze(inp, step)          # the judged window replaces the dwell
                elif not workflow.patched("dwell-between-steps-only"):
                    await workflow.sleep(timedelta(seconds=inp.step_wait_s))   # histories before the patch
                elif step != inp.traffic_steps[-1] and inp.step_wait_s > 0:
                    if self.controls_act_now:       # the dwell ends early on an abort
                        await self._v1_unless_aborted(inp.step_wait_s)
                    else:
                        await workflow.sleep(timedelta(seconds=inp.step_wait_s))
        self._set_phase("done", f"{len(ready)} of {len(inp.hosts)} hosts ready on {inp.version}")
        return {"version_id": info.version_id, "ready": sorted(ready), "hosts": dict(self.hosts),
                "errors": dict(self.errors), "traffic": dict(self.traffic)}

    async def _v1_analyze(self, inp: RolloutInput, step: int) -> None:
        """Observe ``interval_s``, judge the new version against the previous one; a failure aborts (and
        so rolls back) with the numbers in the reason; too little traffic waits another window, up to
        ``max_inconclusive`` times, then the step passes unjudged (said so in the status)."""
        cfg = inp.analysis
        for _ in range(cfg.max_inconclusive + 1):
            self._set_phase("traffic", f"{step}% to {inp.version}: observing for {cfg.interval_s:g} s")
            await self._v1_unless_aborted(cfg.interval_s)
            await self._checkpoint()
            res: AnalysisResult = await workflow.execute_activity(
                "analyze_traffic", AnalysisInput(inp.router, inp.model, inp.version, inp.previous_version, cfg),
                task_queue=CONTROL_QUEUE, result_type=AnalysisResult, start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=10),
                summary=f"analysis at {step}%")
            self.analyses = [*self.analyses[-19:], {"step": step, "verdict": res.verdict, "reason": res.reason,
                                                    "new": res.new, "baseline": res.baseline}]
            if res.verdict == "pass":
                self._set_phase("traffic", f"{step}% analysis passed: {res.reason}")
                return
            if res.verdict == "fail":
                self.abort_reason = f"analysis failed at {step}% (automatic rollback): {res.reason}"
                await self._checkpoint()                    # raises Aborted: traffic back, version discarded
        self._set_phase("traffic", f"{step}% passed UNJUDGED: {self.analyses[-1]['reason']}")

    async def _v1_load_all(self, inp: RolloutInput, info: ManifestInfo) -> bool:
        """Staged loading, at most ``max_loads`` at once. False: the history grew too long, the loads in
        flight were drained and the caller continues-as-new for the rest."""
        queues = {h.id: h.queue for h in inp.hosts}
        verified = [h for h, s in self.hosts.items() if s == "verified"]
        if not workflow.patched("staged-load-loop"):
            # Histories recorded before this patch: every waiting load saw the same free slot, so the cap
            # was not enforced. Kept only so those histories replay.
            await asyncio.gather(*(self._v1_load_unstaged(h, queues[h], inp, info) for h in verified))
            return True
        started = []
        try:
            for host in verified:
                await workflow.wait_condition(lambda: self.loading < min(self.max_loads, MAX_PENDING_LOADS)
                                              or self._v1_abort_now())
                if (workflow.info().get_current_history_length() > inp.max_history_events
                        or workflow.info().is_continue_as_new_suggested()):
                    await self._v1_drain(started)
                    return False
                await self._checkpoint()
                self.loading += 1
                self.hosts[host] = "loading"
                started.append(asyncio.ensure_future(self._v1_load(host, queues[host], inp, info)))
            await self._v1_drain(started)
        except ApplicationError:
            # aborted: loads in flight are cancelled (their activities heartbeat, so the host hears it
            # within a second), not waited for; the discard that follows unloads what they loaded
            for t in started:
                t.cancel()
            await asyncio.gather(*started, return_exceptions=True)
            raise
        return True

    def _v1_abort_now(self) -> bool:
        return self.controls_act_now and bool(self.abort_reason)

    async def _v1_drain(self, started: list) -> None:
        """Wait for the loads in flight; with the controls patch an abort interrupts the wait."""
        if not self.controls_act_now:
            await asyncio.gather(*started)
            return
        await workflow.wait_condition(lambda: all(t.done() for t in started) or bool(self.abort_reason))
        if self.abort_reason:
            await self._checkpoint()                    # raises Aborted

    async def _v1_load_unstaged(self, host: str, queue: str, inp: RolloutInput, info: ManifestInfo) -> None:
        await workflow.wait_condition(lambda: self.loading < self.max_loads)
        self.loading += 1
        self.hosts[host] = "loading"
        await self._v1_load(host, queue, inp, info)

    async def _v1_load(self, host: str, queue: str, inp: RolloutInput, info: ManifestInfo) -> None:
        # older versions make room (unloaded, then removed from the store); pinned ones stay on disk
        keep = [v for v in (inp.version, inp.previous_version) if v]
        try:
            await workflow.execute_activity(
                "load_version", LoadInput(inp.version, info.version_id, keep, inp.router, inp.model,
                                          list(inp.pinned_versions or [])), task_queue=queue,
                schedule_to_start_timeout=timedelta(seconds=inp.unreachable_after_s),
                start_to_close_timeout=timedelta(minutes=30),
                retry_policy=RetryPolicy(maximum_attempts=3), summary=f"load {inp.version} on {host}")
            self.hosts[host] = "ready"
        except ActivityError as e:
            self.hosts[host] = "failed"
            self.errors[host] = str(e.cause or e)
        finally:
            self.loading -= 1

    async def _v1_traffic(self, inp: RolloutInput, weights: dict[str, int], ready: list[str]) -> None:
        await workflow.execute_activity(
            "set_traffic", TrafficInput(inp.router, inp.model, weights,
                                        {h.id: h.model_server for h in inp.hosts if h.id in ready}, sorted(weights)),
            task_queue=CONTROL_QUEUE, start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=30),
            summary=f"traffic {weights}")
        self.traffic = dict(weights)
