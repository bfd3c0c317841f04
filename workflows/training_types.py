"""Inputs, results and status of a durable training run (TrainingWorkflow): plain dataclasses."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from workflows.types import ManifestRef, RolloutInput


@dataclass
class TrainingInput:
    run: str                            # the workflow id is train-<run>
    config: dict                        # TrainConfig as a dict (checked by the CLI before starting)
    hosts: list[str]                    # host ids (queues host-<id>); the first world_size run ranks, the rest are spares
    # where every rank reaches the same checkpoints (a shared volume), or with "{host}" in it each host's
    # own disk (node-local): each checkpoint is then replicated to every rank's host through peerd's swarm
    checkpoint_dir: str
    checkpoint_every: int = 10          # steps between asynchronous checkpoints
    export_dir: str = ""                # where the finished weights are written (safetensors + smoke); empty: not exported
    max_recoveries: int = 5
    heartbeat_timeout_s: float = 10.0   # a rank's host silent this long is lost: its rank migrates to a spare
    collective_timeout_s: float = 60.0  # one collective waiting this long fails the step (a hung peer)
    # a silent host with no spare left: 0 waits for it to return (its rank restarts there); N > 0 goes
    # on with fewer data-parallel ranks (the largest count, at least N, that divides the global batch:
    # the same samples per step, so the same training), surplus healthy hosts becoming spares
    min_world_size: int = 0
    # {endpoint, bucket, prefix}: every complete checkpoint is also copied here (rank 0's host, in the
    # background), and an attempt that finds a newer one here than on the volume restores it first
    checkpoint_archive: dict | None = None
    run_timeout_s: float = 24 * 3600.0
    # after export: publish the weights (upload, sign: the publish worker) and start this rollout, one
    # durable chain. Its manifest is left unset: publishing sets it. Checked before any rank starts.
    rollout: RolloutInput | None = None
    publish_chunk_size: int = 64 << 20
    checkpoint_every_s: float = 0.0     # also checkpoint when this long has passed since the last save (0: off)


HOST_PLACEHOLDER = "{host}"


def node_local(checkpoint_dir: str) -> bool:
    return HOST_PLACEHOLDER in checkpoint_dir


def host_checkpoint_dir(checkpoint_dir: str, host: str) -> str:
    """This host's checkpoint directory (the same path for every host on a shared volume)."""
    return checkpoint_dir.replace(HOST_PLACEHOLDER, host)


def rollout_problems(inp: TrainingInput) -> list[str]:
    """What would make the run's rollout be refused, knowable before training (publishing sets the
    manifest at the end, so a placeholder stands in for it here)."""
    if inp.rollout is None:
        return []
    out = [] if inp.export_dir else ["a rollout needs the exported weights: give export_dir (--export DIR)"]
    return out + replace(inp.rollout, signed_manifest="", manifest=ManifestRef("0" * 64)).problems()


@dataclass
class TrainRankInput:
    run: str
    rank: int
    config: dict
    init_method: str
    attempt: int
    checkpoint_dir: str
    checkpoint_every: int
    collective_timeout_s: float
    archive: dict | None = None         # TrainingInput.checkpoint_archive
    checkpoint_every_s: float = 0.0


@dataclass
class TrainRankResult:
    rank: int
    steps: int
    first_step: int                     # where this attempt resumed (the newest complete checkpoint)
    held_out_loss: float | None         # the final weights on a batch no step trains on (same for any path)
    save_stall_s: list[float]
    paused: bool = False                # stopped at a step boundary on request, its state checkpointed
    # node-local checkpoints: the one this host fetched from its peers before the rank started
    # ({step, version_id, bytes_from_peers, bytes_from_origin}), None when it had it already
    fetched: dict | None = None


@dataclass
class RunControl:
    run: str
    pause: bool
    checkpoint_seq: int


@dataclass
class ExportInput:
    run: str
    config: dict
    checkpoint_dir: str
    export_dir: str
    version: str


@dataclass
class PublishExport:
    """What the publish worker uploads and signs: the export directory (on a volume it reaches)."""
    source: str
    model: str
    version: str
    origin: dict                        # {endpoint, bucket, prefix}
    chunk_size: int


@dataclass
class PublishedExport:
    version_id: str                     # SHA-256 of the signed manifest body
    key: str                            # the signed manifest's object key under the prefix
    bytes: int
    files: int
    already_there: bool                 # a retried publish found the same bytes already published


@dataclass
class Recovery:
    attempt: int                        # the attempt that failed
    rank: int
    host: str
    reason: str
    action: str                         # "restart on <host>" | "migrate to <host>" | "shrink to <n> ranks"
    at: str                             # workflow time, ISO


@dataclass
class TrainingStatus:
    run: str
    phase: str                          # preflight | placing | running | recovering | paused | exporting |
                                        # publishing | rolling out | done | failed | aborted
    attempt: int
    ranks: list[str]                    # host of each rank
    spares: list[str]
    total_steps: int = 0
    tokens_per_step: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)   # first step of each attempt that ran to its end
    # checkpoints a rank's host fetched through the swarm: {attempt, rank, host, step, bytes_from_peers, ...}
    fetched_checkpoints: list[dict] = field(default_factory=list)
    final_loss: float | None = None     # held-out loss of the final weights
    export_dir: str = ""
    detail: str = ""
    version_id: str = ""                # the published manifest's id (with a rollout)
    rollout_id: str = ""                # the child RolloutWorkflow


@dataclass
class TrainingResult:
    run: str
    steps: int
    final_loss: float | None
    recoveries: list[Recovery]
    export_dir: str
    version_id: str = ""
    rollout_id: str = ""
    rollout_ready: list[str] = field(default_factory=list)     # hosts serving the trained weights
