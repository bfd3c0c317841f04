"""The fleet's host list by reference: written once under the origin prefix next to the manifest,
read back (and checked against its SHA-256) by the control activities that need it. Workflows carry
only the ``InventoryRef``."""
from __future__ import annotations

import dataclasses
import hashlib
import json

from peerd.origin import S3Origin
from peerd.seeders import MAX_SEEDERS, seeders_across_racks
from workflows.types import FleetPlan, HostSpec, InventoryRef, host_problems

MAX_INVENTORY_BYTES = 64 * 1024 * 1024     # ~600,000 hosts; more is not a host list


class InventoryError(ValueError):
    """The host list is missing, altered or malformed: retrying will not mend it."""


def encode(hosts: list[HostSpec]) -> tuple[bytes, InventoryRef]:
    """The bytes to upload and the reference a rollout carries (key named by content, so two host lists
    for one checkpoint never overwrite each other)."""
    raw = json.dumps([dataclasses.asdict(h) for h in hosts], separators=(",", ":")).encode()
    digest = hashlib.sha256(raw).hexdigest()
    return raw, InventoryRef(digest, f".weightcast-hosts-{digest[:16]}.json", len(hosts))


def decode(raw: bytes, ref: InventoryRef, need_servers: bool, where: str) -> list[HostSpec]:
    if len(raw) > MAX_INVENTORY_BYTES:
        raise InventoryError(f"{where} is {len(raw)} bytes, over the {MAX_INVENTORY_BYTES}-byte host list limit")
    if hashlib.sha256(raw).hexdigest() != ref.sha256:
        raise InventoryError(f"{where} does not hash to {ref.sha256[:16]}…: changed since the rollout was started")
    try:
        hosts = [HostSpec(**h) for h in json.loads(raw)]
    except (ValueError, TypeError) as e:
        raise InventoryError(f"{where} is not a list of {{id, model_server, rack, task_queue}} objects: {e}") from None
    problems = host_problems(hosts, need_servers)
    if len(hosts) != ref.count:
        problems.append(f"it lists {len(hosts)} hosts, the rollout expects {ref.count}")
    if problems:
        raise InventoryError(f"{where}: " + "; ".join(problems))
    return hosts


async def fetch(origin: S3Origin, ref: InventoryRef, need_servers: bool = False) -> list[HostSpec]:
    """The host list ``ref`` names. ``OriginError`` (transient) propagates: worth a retry."""
    where = f"s3://{origin.spec.bucket}/{origin.spec.key(ref.key)}"
    raw = await origin.read_object(ref.key)
    if raw is None:
        raise InventoryError(f"no host list at {where}")
    return decode(raw, ref, need_servers, where)


def plan(hosts: list[HostSpec]) -> FleetPlan:
    """What the workflow keeps: ids, task queues as indices into the distinct ones, and the seeders."""
    queues = sorted({h.task_queue for h in hosts})
    index = {q: i for i, q in enumerate(queues)}
    return FleetPlan([h.id for h in hosts], queues, [index[h.task_queue] for h in hosts],
                     seeders_across_racks([(h.id, h.rack) for h in hosts], MAX_SEEDERS))
