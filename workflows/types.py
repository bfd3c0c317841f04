"""JSON-friendly dataclasses shared by the rollout workflows and their activities."""
from __future__ import annotations

from dataclasses import dataclass, field

CONTROL_QUEUE = "weightcast-control"


def host_queue(host_id: str) -> str:
    return f"host-{host_id}"


@dataclass
class HostSpec:
    id: str
    model_server: str = ""                # its model server's address, registered with the router
    rack: str = ""


@dataclass
class RolloutInput:
    model: str
    version: str
    signed_manifest: str                  # the signed manifest document (JSON text)
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


@dataclass
class DistributeInput:
    signed_manifest: str
    origin: dict
    seeders: list[str]


@dataclass
class DistributeResult:
    version_id: str
    bytes_total: int
    bytes_by_source: dict
    seconds: float


@dataclass
class LoadInput:
    version: str
    version_id: str


@dataclass
class HostBatchInput:
    hosts: list[HostSpec]
    distribute: DistributeInput
    unreachable_after_s: float


@dataclass
class HostOutcome:
    host: str
    state: str                            # verified | failed | unreachable
    error: str = ""
    bytes_total: int = 0
    seconds: float = 0.0


@dataclass
class ManifestInfo:
    version_id: str
    model: str
    version: str
    bytes_total: int
    chunks: int


@dataclass
class TrafficInput:
    router: str
    model: str
    weights: dict[str, int]
    hosts: dict[str, str] = field(default_factory=dict)   # host id -> model-server address (registration)
    versions: list[str] = field(default_factory=list)


@dataclass
class RolloutStatus:
    phase: str
    hosts: dict[str, str]                 # host -> pending|downloading|verified|loading|ready|failed|unreachable
    counts: dict[str, int]
    bytes_done: int
    bytes_total: int
    paused: bool
    traffic: dict[str, int]
    errors: dict[str, str]
