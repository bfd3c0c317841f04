"""JSON-friendly dataclasses shared by the rollout workflows and their activities."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

class HostState(StrEnum):
    """A host's place in a rollout (the status query's ``hosts``). Strings in every payload and history,
    so histories written before the enum replay unchanged."""
    PENDING = "pending"
    DOWNLOADING = "downloading"
    PAUSED = "paused"                     # its download stopped by a pause; verified chunks kept
    STOPPED = "stopped"                   # a batch child's outcome for a download it stopped
    VERIFIED = "verified"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    UNREACHABLE = "unreachable"           # no worker polled its queue within unreachable_after_s


class Phase(StrEnum):
    """A rollout's phase (the status query's ``phase`` and the ``RolloutPhase`` search attribute)."""
    STARTING = "starting"
    MANIFEST = "manifest"
    DISTRIBUTE = "distribute"
    VERIFY = "verify"
    LOAD = "load"
    TRAFFIC = "traffic"
    DONE = "done"
    FAILED = "failed"
    ABORTING = "aborting"


CONTROL_QUEUE = "weightcast-control"
PUBLISH_QUEUE = "weightcast-publish"      # the publish worker: the only one holding the signing key
HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
INLINE_MANIFEST_MAX = 256 * 1024          # inline manifests only for small checkpoints (legacy input)
INLINE_HOSTS_MAX = 2_000                  # more hosts travel by reference (InventoryRef)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")   # model, version and host ids (go into workflow ids)


def _within(v, low: float, high: float, integer: bool = False) -> bool:
    """A real number (bools and strings from hand-written JSON are not) in [low, high]."""
    kinds = int if integer else (int, float)
    return isinstance(v, kinds) and not isinstance(v, bool) and low <= v <= high


def rollout_id(model: str, version: str) -> str:
    """One rollout per (model, version): its workflow id."""
    return f"rollout-{model}-{version}"


def host_queue(host_id: str) -> str:
    return f"host-{host_id}"


@dataclass
class HostSpec:
    id: str
    model_server: str = ""                # its model server's address, registered with the router
    rack: str = ""
    task_queue: str = ""                  # default host-<id>; set when one agent serves several hosts

    @property
    def queue(self) -> str:
        return self.task_queue or host_queue(self.id)


@dataclass
class ManifestRef:
    """Where a signed manifest lies and what it must hash to. Workflows carry this, never the document:
    a 400 GB checkpoint's manifest is MBs, over Temporal's payload limits once per host."""
    version_id: str                       # SHA-256 of the canonical manifest body
    key: str = ".weightcast-manifest.json"   # object key under the origin prefix

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.version_id, str) or not HEX64.match(self.version_id):
            out.append(f"manifest.version_id {self.version_id!r} must be 64 lowercase hex characters")
        if not isinstance(self.key, str) or not self.key or len(self.key) > 1024:
            out.append("manifest.key must be the object key of the signed manifest under the origin prefix")
        return out


@dataclass
class InventoryRef:
    """Where the fleet's host list lies under the origin prefix (a JSON list of HostSpec objects) and
    what it hashes to. Workflows carry this, not the list: ~100 bytes a host make a 10,000-host list
    the largest payload of a rollout's history (its input, every continue-as-new), near Temporal's
    2 MB limit."""
    sha256: str                           # of the object's bytes
    key: str                              # object key under the origin prefix
    count: int                            # hosts in it

    def problems(self) -> list[str]:
        out = []
        if not isinstance(self.sha256, str) or not HEX64.match(self.sha256):
            out.append(f"inventory.sha256 {self.sha256!r} must be 64 lowercase hex characters")
        if not isinstance(self.key, str) or not self.key or len(self.key) > 1024:
            out.append("inventory.key must be the object key of the host list under the origin prefix")
        if not _within(self.count, 1, 1_000_000, integer=True):
            out.append(f"inventory.count must be the number of hosts in it (1 to 1,000,000), got {self.count!r}")
        return out


def host_problems(hosts: list, need_servers: bool) -> list[str]:
    """What is wrong with a host list (inline in a rollout's input or fetched by reference)."""
    out = []
    if not hosts:
        out.append("hosts is empty: give at least one host")
    if not all(isinstance(h, HostSpec) for h in hosts):
        return out + ["hosts must be objects {id, model_server, rack, task_queue}"]
    ids = [h.id for h in hosts]
    dup = sorted(i for i, n in Counter(map(str, ids)).items() if n > 1)
    if dup:
        out.append(f"duplicate host ids: {', '.join(dup[:10])}")
    bad = [i for i in ids if not isinstance(i, str) or not NAME.match(i)]
    if bad:
        out.append(f"bad host ids (letters, digits, '.', '_', '-'): {bad[:10]}")
    if need_servers and not all(h.model_server for h in hosts):
        out.append("with a router every host needs its model_server address")
    return out


@dataclass
class RolloutInput:
    model: str
    version: str
    signed_manifest: str                  # legacy: the whole document (JSON text); empty when manifest is set
    origin: dict                          # {endpoint, bucket, prefix}
    hosts: list[HostSpec]
    router: str = ""                      # router address; empty = no traffic phase
    previous_version: str = ""            # where abort sends the traffic back
    max_concurrent_loads: int = 2
    failure_budget: float = 0.05          # fraction of hosts that may fail before the rollout pauses
    traffic_steps: list[int] = field(default_factory=lambda: [1, 10, 50, 100])
    step_wait_s: float = 1.0              # dwell at each traffic step
    batch_size: int = 200                 # hosts per child workflow
    unreachable_after_s: float = 120.0    # no worker on host-<id> picks up work → unreachable
    heartbeat_timeout_s: float = 30.0     # a host worker silent this long is presumed dead: retry
    max_history_events: int = 20_000      # continue-as-new past this (Temporal's hard limit is ~50k)
    carry: RolloutCarry | None = None     # set by continue-as-new only, never by callers
    manifest: ManifestRef | None = None   # the manifest by reference (what `weightcast publish` sends)
    pinned_versions: list[str] = field(default_factory=list)   # kept on disk besides this and the previous one
    analysis: AnalysisConfig | None = None   # judge each traffic step before the next (None: timer only)
    stuck_after_s: float = 300.0          # a step failing this long pauses the rollout as stuck, with the reason
    inventory: InventoryRef | None = None  # the hosts by reference (what `weightcast publish` sends); hosts empty

    def problems(self) -> list[str]:
        """Everything wrong with this input, in words an operator can act on (empty when valid)."""
        out = []
        if not isinstance(self.pinned_versions, list) or not all(isinstance(v, str) and v
                                                                 for v in self.pinned_versions):
            out.append(f"pinned_versions is a list of version names, got {self.pinned_versions!r}")
        if self.analysis is not None:
            if not isinstance(self.analysis, AnalysisConfig):
                out.append("analysis must be an AnalysisConfig object")
            else:
                out += self.analysis.problems()
                if not self.router:
                    out.append("analysis compares versions through the router: give router")
        for what, v in (("model", self.model), ("version", self.version)):
            if not isinstance(v, str) or not NAME.match(v):
                out.append(f"{what} {v!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
        if self.manifest is not None:
            out += self.manifest.problems() if isinstance(self.manifest, ManifestRef) else \
                ["manifest must be {version_id, key}: where the signed manifest lies under the origin prefix"]
            if self.signed_manifest:
                out.append("give the manifest by reference (manifest) or inline (signed_manifest), not both")
        elif not isinstance(self.signed_manifest, str) or not self.signed_manifest.strip().startswith("{"):
            out.append("manifest must be {version_id, key} of the published signed manifest "
                       "(`weightcast publish` sets it), or signed_manifest the document itself")
        elif len(self.signed_manifest) > INLINE_MANIFEST_MAX:
            out.append(f"signed_manifest is {len(self.signed_manifest)} characters; over {INLINE_MANIFEST_MAX} "
                       "it would break Temporal's payload limits: publish it and pass manifest={version_id, key}")
        origin = self.origin if isinstance(self.origin, dict) else {}
        missing = [k for k in ("endpoint", "bucket") if not origin.get(k)]
        if missing:
            out.append(f"origin lacks {', '.join(missing)}: give {{endpoint, bucket, prefix}} of the published checkpoint")
        if self.inventory is not None:
            out += self.inventory.problems() if isinstance(self.inventory, InventoryRef) else \
                ["inventory must be {sha256, key, count}: where the host list lies under the origin prefix"]
            if self.hosts:
                out.append("give the hosts by reference (inventory) or inline (hosts), not both")
        else:
            out += host_problems(self.hosts, bool(self.router))
            if len(self.hosts) > INLINE_HOSTS_MAX:
                out.append(f"{len(self.hosts)} hosts inline would make the rollout's input its largest payload; "
                           f"over {INLINE_HOSTS_MAX} upload the list and pass inventory={{sha256, key, count}} "
                           "(`weightcast publish` does)")
        if not _within(self.max_concurrent_loads, 1, 10_000, integer=True):
            out.append(f"max_concurrent_loads must be an integer in [1, 10000], got {self.max_concurrent_loads!r}")
        if not _within(self.failure_budget, 0, 1):
            out.append(f"failure_budget is a fraction in [0, 1], got {self.failure_budget!r}")
        steps = self.traffic_steps
        if (not isinstance(steps, list) or not steps or not all(_within(x, 1e-9, 100) for x in steps)
                or steps != sorted(set(steps)) or steps[-1] != 100):
            out.append(f"traffic_steps must rise strictly within (0, 100] and end at 100, got {steps!r}")
        if not _within(self.batch_size, 1, 1000, integer=True):
            out.append(f"batch_size must be in [1, 1000] (Temporal's pending-activity limit is 2000), got {self.batch_size!r}")
        for what, low in (("unreachable_after_s", 1e-9), ("heartbeat_timeout_s", 1e-9), ("step_wait_s", 0),
                          ("stuck_after_s", 1e-9)):
            if not _within(getattr(self, what), low, float("inf")):
                out.append(f"{what} must be {'positive' if low else 'zero or more'}, got {getattr(self, what)!r}")
        if not _within(self.max_history_events, 1000, float("inf"), integer=True):
            out.append(f"max_history_events must be an integer of at least 1000 (less would continue-as-new "
                       f"constantly), got {self.max_history_events!r}")
        return out


@dataclass
class RolloutCarry:
    """What a rollout carries across continue-as-new: it resumes in ``phase`` with this state."""
    phase: str
    info: ManifestInfo
    hosts: dict[str, str]
    errors: dict[str, str]
    max_loads: int
    paused: bool
    phase_seconds: dict[str, float]
    runs: int
    acked_failures: int = 0


@dataclass
class ManifestCheck:
    ref: ManifestRef
    origin: dict


@dataclass
class InventoryCheck:
    ref: InventoryRef
    origin: dict
    need_servers: bool = False            # a router: every host needs its model_server


@dataclass
class FleetPlan:
    """What a rollout keeps of a host list given by reference: ids and task queues (for fan-out and
    loads) and the seeders picked across racks; model-server addresses stay in the list (the traffic
    step reads them there)."""
    ids: list[str]
    queues: list[str]                     # the distinct task queues the list names ("" = host-<id>)
    queue_of: list[int]                   # each host's, an index into queues
    seeders: list[str]

    def specs(self) -> list[HostSpec]:
        return [HostSpec(i, task_queue=self.queues[q]) for i, q in zip(self.ids, self.queue_of)]


@dataclass
class DistributeInput:
    signed_manifest: str                  # legacy inline document; empty when manifest is set
    origin: dict
    seeders: list[str]
    manifest: ManifestRef | None = None


@dataclass
class DistributeResult:
    version_id: str
    bytes_total: int
    bytes_by_source: dict
    seconds: float
    stopped: bool = False                 # stopped before complete (the rollout paused or aborted)
    bytes_held: int = 0                   # verified bytes on the host's disk when it stopped


@dataclass
class LoadInput:
    version: str
    version_id: str
    keep: list[str] = field(default_factory=list)   # versions to keep loaded; others are retired first
    router: str = ""                                 # asked for an unload permit before a retirement
    model: str = ""
    pinned: list[str] = field(default_factory=list)  # not loaded necessarily, but kept in the store


@dataclass
class PreflightInput:
    """What `weightcast publish` asks the control plane before it uploads anything."""
    signed_probe: str               # a tiny manifest signed with the publishing key
    model: str
    router: str = ""
    previous_version: str = ""


@dataclass
class DiscardInput:
    """After an abort: take this version off a host (model server and peerd's store)."""
    version: str
    version_id: str
    model: str = ""                       # "": the model the stored manifest names


@dataclass
class HostBatchInput:
    hosts: list[HostSpec]
    distribute: DistributeInput
    unreachable_after_s: float
    heartbeat_timeout_s: float = 30.0
    stoppable: bool = False               # the parent stops the batch by signal; hosts report bytes held


@dataclass
class HostOutcome:
    host: str
    state: str                            # a HostState: verified | failed | unreachable | stopped
    error: str = ""
    bytes_total: int = 0
    seconds: float = 0.0
    bytes_held: int = -1                  # stopped: verified bytes kept on disk (-1: the host did not say)


@dataclass
class ManifestInfo:
    version_id: str
    model: str
    version: str
    bytes_total: int
    chunks: int


@dataclass
class AnalysisConfig:
    """Canary analysis after each traffic step (Argo Rollouts' AnalysisTemplate / Flagger's canary
    analysis): observe the router's numbers for ``interval_s``, then compare the new version with the
    previous one. A failed analysis aborts the rollout and sends traffic back automatically."""
    interval_s: float = 60.0              # observation window after each step
    min_requests: int = 20                # fewer requests to the new version: inconclusive, wait another window
    max_error_rate: float = 0.05          # absolute ceiling for the new version
    max_error_rate_increase: float = 0.01 # new error rate may exceed the previous one's by at most this
    max_p99_ratio: float = 1.5            # new p99 latency at most this times the previous one's ...
    min_p99_increase_ms: float = 10.0     # ... unless it is within this many ms of it: over a short window
                                          # p99 is the slowest few requests, and one scheduling hiccup
                                          # turns 3 ms into 10 ms, a ratio of 3 that no user notices
    max_inconclusive: int = 3             # windows without enough requests before the step passes unjudged

    def problems(self) -> list[str]:
        out = []
        for name in ("interval_s", "max_p99_ratio"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6:
                out.append(f"analysis.{name} must be a positive number, got {v!r}")
        v = self.min_p99_increase_ms
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e9:
            out.append(f"analysis.min_p99_increase_ms must be a number >= 0, got {v!r}")
        for name in ("max_error_rate", "max_error_rate_increase"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                out.append(f"analysis.{name} is a fraction in [0, 1], got {v!r}")
        for name in ("min_requests", "max_inconclusive"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 10**9:
                out.append(f"analysis.{name} must be a non-negative integer, got {v!r}")
        return out


@dataclass
class AnalysisInput:
    router: str
    model: str
    version: str
    baseline: str                         # the previous version ("" : absolute thresholds only)
    config: AnalysisConfig


@dataclass
class AnalysisResult:
    verdict: str                          # pass | fail | inconclusive
    reason: str
    new: dict = field(default_factory=dict)          # {requests, errors, error_rate, p50_ms, p99_ms}
    baseline: dict = field(default_factory=dict)


@dataclass
class TrafficInput:
    router: str
    model: str
    weights: dict[str, int]
    hosts: dict[str, str] = field(default_factory=dict)   # host id -> model-server address (registration)
    versions: list[str] = field(default_factory=list)
    inventory: InventoryRef | None = None   # hosts by reference: every listed host's server but ``exclude``
    origin: dict = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)


@dataclass
class RolloutStatus:
    phase: str
    hosts: dict[str, str]   # host -> pending|downloading|paused|verified|loading|ready|failed|unreachable|discarded
    counts: dict[str, int]
    bytes_done: int
    bytes_total: int
    paused: bool
    traffic: dict[str, int]
    errors: dict[str, str]
    version_id: str = ""
    batches: list[str] = field(default_factory=list)      # child workflow ids (live progress: describe them)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    runs: int = 1                                          # 1 + continue-as-new count
    detail: str = ""                                       # what the phase is doing or waiting for, and why
    analyses: list[dict] = field(default_factory=list)     # the last canary judgments: step, verdict, numbers
    held: dict[str, int] = field(default_factory=dict)     # host -> verified bytes kept while its download stopped
    retrying: list[dict] = field(default_factory=list)     # steps failing now: step, activity, attempt, next retry, error
    stuck_step: str = ""                                   # a step failing past stuck_after_s (the rollout pauses)
    control: str = ""                                      # a pause or abort asked for and not yet acted on
    peak_loads: int = 0                                    # most hosts loading at once so far
