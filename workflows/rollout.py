"""RolloutWorkflow: one durable rollout per (model, version), id ``rollout-<model>-<version>``.

Phases (visible as current details and the ``RolloutPhase`` search attribute): manifest → distribute
(seeding and swarm, every chunk verified on arrival) → verify → load (staged) → traffic → done.
Deterministic: no I/O here, activities are named, time comes from the workflow clock.
History stays bounded: hosts fan out through one child workflow per batch, and the load phase
continues-as-new (carrying its state) once the history passes ``max_history_events``.

Every step that calls out (the manifest check, each host's load, each traffic step, each canary
analysis) runs through ``_step``: one attempt per activity, retried here with back-off rather than by
the server, so that a pause or an abort cancels a retrying step at once in every phase, status shows
which step is failing and why, and a step failing for longer than ``stuck_after_s`` pauses the
rollout as stuck instead of retrying out of sight.
"""
from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import (ActivityError, ApplicationError, FailureError, TimeoutError as TemporalTimeout,
                                   TimeoutType)

with workflow.unsafe.imports_passed_through():
    from peerd.seeders import MAX_SEEDERS, seeders_across_racks
    from workflows.host_batch import HostBatchWorkflow
    from workflows.types import (CONTROL_QUEUE, AnalysisInput, AnalysisResult, DiscardInput, DistributeInput,
                                 FleetPlan, HostBatchInput, HostOutcome, HostSpec, HostState, InventoryCheck, LoadInput,
                                 ManifestCheck, ManifestInfo, Phase, RolloutCarry, RolloutInput, RolloutStatus,
                                 TrafficInput)

PHASE = SearchAttributeKey.for_keyword("RolloutPhase")
STEPS_PATCH = "controls-preempt-retries"     # deprecated: every open run has it
MAX_PENDING_LOADS = 1000      # Temporal allows 2,000 pending activities per workflow
BACKOFF_MAX_S = 30.0          # retries of a failing step: 1, 2, 4, ... seconds, at most this
DISCARD_WAIT_S = 15.0         # an abort waits at most this long for a host's worker to take its discard
DONE_STATES = (HostState.VERIFIED, HostState.LOADING, HostState.READY)


def _final(e: ActivityError) -> bool:
    """A failure that retrying will not mend: refused as non-retryable, or never picked up by a worker."""
    cause = e.cause
    if isinstance(cause, ApplicationError) and cause.non_retryable:
        return True
    return isinstance(cause, TemporalTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START


@workflow.defn
class RolloutWorkflow:
    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.hosts: dict[str, str] = {}
        self.specs: list[HostSpec] = []    # the fleet: inline, or ids and queues of a host list by reference
        self.seeders: list[str] = []
        self.errors: dict[str, str] = {}
        self.paused = False
        self.abort_reason = ""
        self.max_loads = 2
        self.loading = 0
        self.peak_loading = 0         # most loads running at once (status: the concurrency limit at work)
        self.traffic: dict[str, int] = {}
        self.bytes_total = 0
        self.version_id = ""
        self.batches: list[str] = []
        self.phase_seconds: dict[str, float] = {}
        self._phase_t0 = 0.0
        self.runs = 1
        self.acked_failures = 0       # failures the operator has seen and resumed past
        self.detail = ""
        self.analyses: list[dict] = []     # the last canary judgments (status)
        self.held: dict[str, int] = {}     # host -> verified bytes kept while its download is stopped
        self.retrying: dict[str, dict] = {}   # step -> its latest failure and next retry
        self.stuck = ""                    # a step failing past stuck_after_s, until resumed
        self.holding = False               # a pause has been acted on: nothing runs until resume
        self._before_pause = ""

    # ---------------------------------------------------------------- controls
    @workflow.query
    def status(self) -> RolloutStatus:
        counts: dict[str, int] = {}
        for s in self.hosts.values():
            counts[s] = counts.get(s, 0) + 1
        done = sum(1 for s in self.hosts.values() if s in DONE_STATES)
        held = sum(b for h, b in self.held.items() if self.hosts.get(h) not in DONE_STATES)
        return RolloutStatus(phase=self.phase, hosts=dict(self.hosts), counts=counts,
                             bytes_done=done * self.bytes_total + held,
                             bytes_total=len(self.hosts) * self.bytes_total,
                             paused=self.paused, traffic=dict(self.traffic), errors=dict(self.errors),
                             version_id=self.version_id, batches=list(self.batches),
                             phase_seconds=dict(self.phase_seconds), runs=self.runs, detail=self.detail,
                             analyses=list(self.analyses), held=dict(self.held),
                             retrying=list(self.retrying.values()), stuck_step=self.stuck, control=self._control(),
                             peak_loads=self.peak_loading)

    def _control(self) -> str:
        """A control asked for and not yet acted on, in words."""
        if self.abort_reason and self.phase == Phase.ABORTING:
            return f"abort requested ({self.abort_reason}), being carried out: {self.detail}"
        if self.abort_reason and self.phase not in (Phase.FAILED, Phase.DONE):
            return f"abort requested ({self.abort_reason}): stopping {self.phase}"
        if self.paused and not self.holding and self.phase not in (Phase.FAILED, Phase.DONE):
            return f"pause requested: stopping what {self.phase} is running"
        return ""

    @workflow.signal
    def pause(self) -> None:
        self.paused = True

    @workflow.signal
    def resume(self) -> None:
        self.paused = False
        self.stuck = ""

    @workflow.update
    def abort(self, reason: str) -> str:
        self.abort_reason = reason
        return f"aborting: {reason}"

    @abort.validator
    def _validate_abort(self, reason: str) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("abort needs a reason (it goes into the audit trail)")
        if self.phase == Phase.DONE:
            raise ValueError("the rollout is already done; start a rollback instead")

    @workflow.update
    def set_max_concurrent_loads(self, n: int) -> int:
        self.max_loads = n
        return n

    @set_max_concurrent_loads.validator
    def _validate_loads(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 10_000:
            raise ValueError(f"max_concurrent_loads must be an integer in [1, 10000], got {n!r}")

    # ---------------------------------------------------------------- phases
    def _set_phase(self, phase: Phase, detail: str = "") -> None:
        now = workflow.time()
        timed = (Phase.MANIFEST, Phase.DISTRIBUTE, Phase.VERIFY, Phase.LOAD, Phase.TRAFFIC)
        if phase != self.phase and self.phase in timed:
            self.phase_seconds[self.phase] = round(self.phase_seconds.get(self.phase, 0.0) + now - self._phase_t0, 3)
        if phase != self.phase:
            self._phase_t0 = now
        self.phase, self.detail = phase, detail
        workflow.upsert_search_attributes([PHASE.value_set(phase)])
        workflow.set_current_details(f"**{phase}** {detail}".strip())

    def _controlled(self) -> bool:
        return self.paused or bool(self.abort_reason)

    async def _checkpoint(self) -> None:
        """Honour pause and abort: an abort raises Aborted, a pause holds until resume (or abort)."""
        if self.paused and not self.abort_reason:
            self.holding = True
        await workflow.wait_condition(lambda: not self.paused or bool(self.abort_reason))
        self.holding = False
        if self.abort_reason:
            raise ApplicationError(f"aborted: {self.abort_reason}", type="Aborted", non_retryable=True)

    async def _hold(self) -> None:
        """``_checkpoint``, saying in the UI that the rollout is paused while it holds."""
        if self.paused and not self.abort_reason and not self.detail.startswith(("PAUSED", "STUCK")):
            self._before_pause = self.detail
            self._set_phase(self.phase, f"PAUSED by an operator during: {self.detail or self.phase}; resume or abort")
        await self._checkpoint()
        if self.detail.startswith(("PAUSED", "STUCK")):
            self._set_phase(self.phase, f"resumed: {self._before_pause}".strip())

    async def _dwell(self, seconds: float) -> None:
        """A timer that an abort ends and a pause restarts: a bake or an observation window is
        ``seconds`` of uninterrupted running."""
        while True:
            try:
                await workflow.wait_condition(self._controlled, timeout=timedelta(seconds=seconds))
                await self._hold()
            except asyncio.TimeoutError:
                return

    async def _step(self, inp: RolloutInput, label: str, activity: str, arg, *, queue: str, summary: str,
                    result_type=None, attempts: int = 0, timeout_s: float = 30.0,
                    schedule_to_start_s: float | None = None, heartbeat_s: float | None = None):
        """One step of the rollout: ``activity`` run one attempt at a time, retried here with back-off
        (1 s doubling to BACKOFF_MAX_S) up to ``attempts`` (0: no limit but ``stuck_after_s``). A pause
        or an abort cancels the running attempt or the wait for the next one at once; a pause then
        holds and runs the step again on resume. A step failing for ``stuck_after_s`` pauses the
        rollout as stuck, with its error. Raises ActivityError when it gives up, Aborted on abort.
        Activity ids are ``<label>#<n>``: status tells from them which host a pending load is for."""
        attempt, starts, failing_since = 0, 0, None
        try:
            while True:
                await self._hold()
                attempt, starts = attempt + 1, starts + 1
                act = workflow.start_activity(
                    activity, arg, task_queue=queue, result_type=result_type, activity_id=f"{label}#{starts}",
                    start_to_close_timeout=timedelta(seconds=timeout_s),
                    schedule_to_start_timeout=timedelta(seconds=schedule_to_start_s) if schedule_to_start_s else None,
                    heartbeat_timeout=timedelta(seconds=heartbeat_s) if heartbeat_s else None,
                    retry_policy=RetryPolicy(maximum_attempts=1),
                    summary=summary if attempt == 1 else f"{summary} (attempt {attempt})")
                await workflow.wait_condition(lambda: act.done() or self._controlled())
                if not act.done():                  # a control arrived: cancel this attempt, then hold or abort
                    act.cancel()
                    await asyncio.gather(act, return_exceptions=True)
                    attempt -= 1
                    continue
                try:
                    return act.result()
                except ActivityError as e:
                    if _final(e) or (attempts and attempt >= attempts):
                        raise
                    error = str(e.cause or e)
                now = workflow.time()
                failing_since = now if failing_since is None else failing_since
                delay = min(BACKOFF_MAX_S, 2.0 ** (attempt - 1))
                self.retrying[label] = {
                    "step": label, "activity": activity, "attempt": attempt, "error": error[:500],
                    "failing_for_s": round(now - failing_since, 1),
                    "next_retry_at": (workflow.now() + timedelta(seconds=delay)).isoformat()}
                if now - failing_since >= inp.stuck_after_s:
                    self.stuck = (f"{label} has failed for {now - failing_since:.0f} s ({attempt} attempts): "
                                  f"{error[:300]}")
                    self.paused, failing_since = True, None
                    self._before_pause = self.detail if not self.detail.startswith("STUCK") else self._before_pause
                    self._set_phase(self.phase, f"STUCK, PAUSED: {self.stuck}; mend it and resume, or abort")
                    continue
                await self._dwell_once(delay)
        finally:
            self.retrying.pop(label, None)

    async def _dwell_once(self, seconds: float) -> None:
        """Wait ``seconds`` unless a control arrives first (the caller then holds or aborts)."""
        try:
            await workflow.wait_condition(self._controlled, timeout=timedelta(seconds=seconds))
        except asyncio.TimeoutError:
            pass

    @workflow.run
    async def run(self, inp: RolloutInput) -> dict:
        problems = inp.problems()
        if problems:
            raise ApplicationError("invalid rollout input: " + "; ".join(problems), type="InvalidInput",
                                   non_retryable=True)
        self.max_loads = inp.max_concurrent_loads
        self.specs = list(inp.hosts)
        self.hosts = {h.id: HostState.PENDING for h in inp.hosts}
        self._phase_t0 = workflow.time()
        workflow.deprecate_patch(STEPS_PATCH)        # the earlier paths are gone; the marker stays one release
        try:
            if inp.carry:
                return await self._resume(inp, inp.carry)
            return await self._run(inp)
        except ApplicationError as e:
            failure = await self._after_abort(inp) if e.type == "Aborted" else None
            self.retrying.clear()
            self._set_phase(Phase.FAILED, str(failure or e))
            if failure:
                raise failure from None
            raise

    async def _after_abort(self, inp: RolloutInput) -> ApplicationError | None:
        """Traffic back to the previous version, then the aborted version taken off every host. Returns
        the error to end with when moving traffic back failed (the workflow still ends failed, saying so)."""
        self.retrying.clear()
        if inp.router and inp.previous_version:
            self._set_phase(Phase.ABORTING, f"moving traffic back to {inp.previous_version}")
            try:
                await self._traffic_now(inp, {inp.previous_version: 100})
            except ActivityError as te:
                return ApplicationError(f"aborted: {self.abort_reason}; AND moving traffic back to "
                                        f"{inp.previous_version} failed: {te.cause or te}", type="RollbackFailed",
                                        non_retryable=True)
        if not self.version_id:
            return None
        if self.traffic.get(inp.version):
            # no previous version to move its traffic to: it keeps serving, so it stays where it is
            self._set_phase(Phase.ABORTING, f"{inp.version} still carries {self.traffic[inp.version]}% of traffic "
                                        "(no previous version to return to): left loaded and stored")
            return None
        # a host no worker served (unreachable) is not waited for again: what it may hold is pruned by
        # its next rollout, and it never loaded this version
        hosts = [h for h in self.specs if self.hosts.get(h.id) != HostState.UNREACHABLE]
        self._set_phase(Phase.ABORTING, f"removing {inp.version} from {len(hosts)} hosts")
        results = await asyncio.gather(*(workflow.execute_activity(
            "discard_version", DiscardInput(inp.version, self.version_id, inp.model), task_queue=h.queue,
            schedule_to_start_timeout=timedelta(seconds=min(inp.unreachable_after_s, DISCARD_WAIT_S)),
            start_to_close_timeout=timedelta(seconds=120), retry_policy=RetryPolicy(maximum_attempts=3),
            summary=f"discard {inp.version} on {h.id}") for h in hosts), return_exceptions=True)
        for h, r in zip(hosts, results):
            if isinstance(r, BaseException):
                self.errors[h.id] = f"could not remove the aborted version: {getattr(r, 'cause', None) or r}"
            elif self.hosts.get(h.id) not in (HostState.FAILED, HostState.UNREACHABLE):
                self.hosts[h.id] = "discarded"
        return None

    async def _run(self, inp: RolloutInput) -> dict:
        self._set_phase(Phase.MANIFEST, "checking the signature")
        try:
            if inp.manifest is not None:   # by reference: the activity fetches it and checks digest and signature
                info: ManifestInfo = await self._step(
                    inp, "manifest", "check_manifest_ref", ManifestCheck(inp.manifest, inp.origin),
                    queue=CONTROL_QUEUE, result_type=ManifestInfo, attempts=5, timeout_s=300,
                    summary="fetch and verify the signed manifest")
            else:
                info = await self._step(inp, "manifest", "check_manifest", inp.signed_manifest, queue=CONTROL_QUEUE,
                                        result_type=ManifestInfo, attempts=1, timeout_s=300,
                                        summary="verify manifest signature")
        except ActivityError as e:
            raise ApplicationError(f"manifest refused, nothing loaded: {e.cause}", type="ManifestRefused",
                                   non_retryable=True) from None
        if (info.model, info.version) != (inp.model, inp.version):
            raise ApplicationError(f"manifest is {info.model}/{info.version}, rollout is {inp.model}/{inp.version}",
                                   non_retryable=True)
        self.bytes_total, self.version_id = info.bytes_total, info.version_id
        if inp.inventory is not None:
            await self._fleet(inp)
            self.hosts = {h.id: HostState.PENDING for h in self.specs}
        else:
            self.seeders = seeders_across_racks([(h.id, h.rack) for h in inp.hosts], MAX_SEEDERS)

        await self._hold()
        self._set_phase(Phase.DISTRIBUTE, f"{len(self.specs)} hosts, {info.bytes_total} bytes")
        await self._distribute(inp, DistributeInput(inp.signed_manifest, inp.origin, self.seeders, inp.manifest))
        await self._budget(inp)

        self._set_phase(Phase.VERIFY, "every chunk was checked against the signed manifest on arrival")
        await self._hold()
        self._set_phase(Phase.LOAD, f"at most {self.max_loads} hosts at a time")
        return await self._load_and_shift(inp, info)

    async def _fleet(self, inp: RolloutInput) -> None:
        """The host list by reference: fetched and checked by the control worker, which hands back
        only ids, queues and seeders (a few bytes a host in this history)."""
        self._set_phase(self.phase, f"reading the host list ({inp.inventory.count} hosts)")
        try:
            plan: FleetPlan = await self._step(
                inp, "inventory", "check_inventory", InventoryCheck(inp.inventory, inp.origin, bool(inp.router)),
                queue=CONTROL_QUEUE, result_type=FleetPlan, attempts=5, timeout_s=300,
                summary=f"fetch and check the host list ({inp.inventory.count} hosts)")
        except ActivityError as e:
            raise ApplicationError(f"host list refused, nothing distributed: {e.cause}", type="InventoryRefused",
                                   non_retryable=True) from None
        self.specs, self.seeders = plan.specs(), plan.seeders

    async def _distribute(self, inp: RolloutInput, dist: DistributeInput) -> None:
        """The batch children, stopped by signal the moment a pause or an abort arrives: each host stops
        peerd's download and reports the verified bytes it keeps (status shows them while paused). On
        resume new children (new ids) start for the hosts not yet done; each continues from its bitmap."""
        todo: list[HostSpec] = list(self.specs)
        round_ = 0
        while todo:
            for h in todo:
                self.hosts[h.id] = HostState.DOWNLOADING
            batches = [todo[i:i + inp.batch_size] for i in range(0, len(todo), inp.batch_size)]
            suffix = "" if round_ == 0 else f"-r{round_}"
            self.batches = [f"{workflow.info().workflow_id}-batch-{i}{suffix}" for i in range(len(batches))]
            children = await asyncio.gather(*(workflow.start_child_workflow(
                HostBatchWorkflow.run, HostBatchInput(b, dist, inp.unreachable_after_s, inp.heartbeat_timeout_s,
                                                      stoppable=True),
                id=self.batches[i], result_type=list[HostOutcome]) for i, b in enumerate(batches)))
            await workflow.wait_condition(lambda: all(c.done() for c in children) or self._controlled())
            await asyncio.gather(*(self._stop_batch(c) for c in children if not c.done()))
            for outcome in (o for batch in await asyncio.gather(*children) for o in batch):
                if outcome.state == HostState.STOPPED:
                    self.hosts[outcome.host] = HostState.PAUSED
                    if outcome.bytes_held >= 0:
                        self.held[outcome.host] = outcome.bytes_held
                    continue
                self.hosts[outcome.host] = outcome.state
                self.held.pop(outcome.host, None)
                if outcome.error:
                    self.errors[outcome.host] = outcome.error
            todo = [h for h in self.specs if self.hosts[h.id] == HostState.PAUSED]
            if todo:
                if not self.abort_reason:
                    self._set_phase(Phase.DISTRIBUTE, f"PAUSED: {len(todo)} downloads stopped, verified chunks kept "
                                                  f"({sum(self.held.get(h.id, 0) for h in todo)} bytes); resume or abort")
                await self._checkpoint()
                self._set_phase(Phase.DISTRIBUTE, f"resumed: {len(todo)} hosts continue from their bitmaps")
                round_ += 1

    @staticmethod
    async def _stop_batch(child) -> None:
        try:
            await child.signal(HostBatchWorkflow.stop)
        except FailureError:
            pass        # it ended meanwhile: its outcomes are final, nothing to stop

    def _restore(self, c: RolloutCarry) -> None:
        """The state a continued-as-new run carries over (both code paths)."""
        self.hosts, self.errors, self.max_loads, self.paused = dict(c.hosts), dict(c.errors), c.max_loads, c.paused
        self.bytes_total, self.version_id, self.runs = c.info.bytes_total, c.info.version_id, c.runs
        self.phase_seconds, self.phase, self.acked_failures = dict(c.phase_seconds), c.phase, c.acked_failures
        self._set_phase(c.phase, f"continued (run {self.runs}); at most {self.max_loads} hosts loading at a time")

    async def _continue_as_new(self, inp: RolloutInput, info: ManifestInfo) -> None:
        """Drain the handlers, then start the next run of this rollout with the state carried."""
        await workflow.wait_condition(workflow.all_handlers_finished)
        self.phase_seconds["load"] = round(self.phase_seconds.get("load", 0.0) + workflow.time() - self._phase_t0, 3)
        carry = RolloutCarry("load", info, dict(self.hosts), dict(self.errors), self.max_loads, self.paused,
                             dict(self.phase_seconds), self.runs + 1, self.acked_failures)
        workflow.continue_as_new(dataclasses.replace(inp, carry=carry))

    async def _resume(self, inp: RolloutInput, c: RolloutCarry) -> dict:
        """A continued-as-new run: restore the state and carry on loading."""
        self._restore(c)
        if inp.inventory is not None:
            await self._fleet(inp)
        return await self._load_and_shift(inp, c.info)

    async def _load_and_shift(self, inp: RolloutInput, info: ManifestInfo) -> dict:
        if not await self._load_all(inp, info):
            await self._continue_as_new(inp, info)
        await self._budget(inp)
        ready = [h for h, s in self.hosts.items() if s == HostState.READY]

        if inp.router:
            servers = {h.id: h.model_server for h in inp.hosts if h.id in ready}
            not_ready = sorted(set(self.hosts) - set(ready))
            for step in inp.traffic_steps:
                await self._hold()
                self._set_phase(Phase.TRAFFIC, f"{step}% to {inp.version}")
                weights = {inp.version: step}
                if inp.previous_version and step < 100:
                    weights[inp.previous_version] = 100 - step
                await self._step(inp, f"traffic {step}%", "set_traffic",
                                 TrafficInput(inp.router, inp.model, weights, servers, sorted(weights),
                                              **self._by_reference(inp, not_ready)),
                                 queue=CONTROL_QUEUE, summary=f"traffic {weights}")
                self.traffic = dict(weights)
                if inp.analysis is not None and step < 100:
                    await self._analyze(inp, step)          # the judged window replaces the dwell
                elif step != inp.traffic_steps[-1] and inp.step_wait_s > 0:
                    await self._dwell(inp.step_wait_s)
        self._set_phase(Phase.DONE, f"{len(ready)} of {len(self.specs)} hosts ready on {inp.version}")
        return {"version_id": info.version_id, "ready": sorted(ready), "hosts": dict(self.hosts),
                "errors": dict(self.errors), "traffic": dict(self.traffic), "peak_loads": self.peak_loading,
                "phase_seconds": dict(self.phase_seconds)}      # in the history: where the rollout's time went

    @staticmethod
    def _by_reference(inp: RolloutInput, not_ready: list[str]) -> dict:
        """A traffic step's hosts by reference: the list's servers but those not ready."""
        if inp.inventory is None:
            return {}
        return {"inventory": inp.inventory, "origin": inp.origin, "exclude": not_ready}

    async def _analyze(self, inp: RolloutInput, step: int) -> None:
        """Observe ``interval_s``, judge the new version against the previous one; a failure aborts (and
        so rolls back) with the numbers in the reason; too little traffic waits another window, up to
        ``max_inconclusive`` times, then the step passes unjudged (said so in the status)."""
        cfg = inp.analysis
        for _ in range(cfg.max_inconclusive + 1):
            self._set_phase(Phase.TRAFFIC, f"{step}% to {inp.version}: observing for {cfg.interval_s:g} s")
            await self._dwell(cfg.interval_s)
            res: AnalysisResult = await self._step(
                inp, f"analysis at {step}%", "analyze_traffic",
                AnalysisInput(inp.router, inp.model, inp.version, inp.previous_version, cfg),
                queue=CONTROL_QUEUE, result_type=AnalysisResult, attempts=10, summary=f"analysis at {step}%")
            self.analyses = [*self.analyses[-19:], {"step": step, "verdict": res.verdict, "reason": res.reason,
                                                    "new": res.new, "baseline": res.baseline}]
            if res.verdict == "pass":
                self._set_phase(Phase.TRAFFIC, f"{step}% analysis passed: {res.reason}")
                return
            if res.verdict == "fail":
                self.abort_reason = f"analysis failed at {step}% (automatic rollback): {res.reason}"
                await self._checkpoint()                    # raises Aborted: traffic back, version discarded
        self._set_phase(Phase.TRAFFIC, f"{step}% passed UNJUDGED: {self.analyses[-1]['reason']}")

    async def _budget(self, inp: RolloutInput) -> None:
        """Past the failure budget, pause for an operator; once resumed, only new failures pause again."""
        bad = [h for h, s in self.hosts.items() if s in (HostState.FAILED, HostState.UNREACHABLE)]
        if len(bad) > inp.failure_budget * len(self.hosts) and len(bad) > self.acked_failures:
            self.paused = True
            self._set_phase(self.phase, f"PAUSED: {len(bad)} hosts failed, over the {inp.failure_budget:.0%} "
                                        "budget; resume or abort")
            await self._checkpoint()
            self.acked_failures = len(bad)

    async def _load_all(self, inp: RolloutInput, info: ManifestInfo) -> bool:
        """Staged loading, at most ``max_loads`` at once (``set_max_concurrent_loads`` changes it while it
        runs). False: the history grew too long, the loads in flight were drained and the caller
        continues-as-new for the rest. A pause holds every load (each cancels its running attempt and
        runs again on resume); an abort ends them all."""
        queues = {h.id: h.queue for h in self.specs}
        started: list[asyncio.Task] = []
        try:
            for host in [h for h, s in self.hosts.items() if s == HostState.VERIFIED]:
                while True:
                    await workflow.wait_condition(lambda: self.loading < min(self.max_loads, MAX_PENDING_LOADS)
                                                  or self._controlled())
                    if not self._controlled():
                        break
                    await self._hold()
                if (workflow.info().get_current_history_length() > inp.max_history_events
                        or workflow.info().is_continue_as_new_suggested()):
                    await self._drain(started)
                    return False
                self.loading += 1
                self.peak_loading = max(self.peak_loading, self.loading)
                self.hosts[host] = HostState.LOADING
                started.append(asyncio.ensure_future(self._load(host, queues[host], inp, info)))
            await self._drain(started)
        except ApplicationError:
            await asyncio.gather(*started, return_exceptions=True)   # each ends on the abort by itself
            raise
        return True

    async def _drain(self, started: list[asyncio.Task]) -> None:
        """Wait for the loads in flight; an abort ends them (they raise it)."""
        for r in await asyncio.gather(*started, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    async def _load(self, host: str, queue: str, inp: RolloutInput, info: ManifestInfo) -> None:
        # older versions of this model make room (unloaded, then removed from the store); pinned ones stay on disk
        keep = [v for v in (inp.version, inp.previous_version) if v]
        try:
            await self._step(inp, f"load {host}", "load_version",
                             LoadInput(inp.version, info.version_id, keep, inp.router, inp.model,
                                       list(inp.pinned_versions or [])),
                             queue=queue, attempts=3, timeout_s=1800, schedule_to_start_s=inp.unreachable_after_s,
                             heartbeat_s=inp.heartbeat_timeout_s, summary=f"load {inp.version} on {host}")
            self.hosts[host] = HostState.READY
        except ActivityError as e:
            cause = e.cause
            unreachable = isinstance(cause, TemporalTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START
            self.hosts[host] = HostState.UNREACHABLE if unreachable else HostState.FAILED
            self.errors[host] = f"no worker polled {queue}" if unreachable else str(cause or e)
        finally:
            self.loading -= 1

    async def _traffic_now(self, inp: RolloutInput, weights: dict[str, int]) -> None:
        """Set the weights while aborting: no control can preempt it, so its retries are bounded (about
        half a minute) and a failure is reported, not waited out."""
        await workflow.execute_activity(
            "set_traffic", TrafficInput(inp.router, inp.model, weights, {}, sorted(weights)),
            task_queue=CONTROL_QUEUE, start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=8),
                                     maximum_attempts=6),
            summary=f"traffic {weights} (abort)")
        self.traffic = dict(weights)
