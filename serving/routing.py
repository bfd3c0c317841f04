"""The routing table as a pure state machine (no sockets): which host may answer which request.

Invariant: a request is only ever routed to a host that is, in this table, ready for the version the
request is routed to. There is no panic mode: no ready host means ``NoReadyHost`` (503).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


class RoutingError(Exception):
    status = 500


class UnknownVersion(RoutingError):
    status = 404


class NoReadyHost(RoutingError):
    status = 503


class WeightRefused(RoutingError):
    status = 409


@dataclass
class ModelRoute:
    hosts: dict[str, str] = field(default_factory=dict)          # host id -> address
    weights: dict[str, float] = field(default_factory=dict)      # version -> weight (known versions)
    ready: set[tuple[str, str]] = field(default_factory=set)     # (host, version)

    def ready_hosts(self, version: str) -> list[str]:
        return sorted(h for h, v in self.ready if v == version and h in self.hosts)


class RoutingTable:
    def __init__(self, seed: int | None = None, slack: float = 1e-9):
        self.models: dict[str, ModelRoute] = {}
        self.rng = random.Random(seed)
        self.slack = slack

    def model(self, name: str) -> ModelRoute:
        if name not in self.models:
            raise UnknownVersion(f"unknown model {name!r}")
        return self.models[name]

    # ---------------------------------------------------------------- events
    def add_host(self, model: str, host: str, addr: str) -> None:
        self.models.setdefault(model, ModelRoute()).hosts[host] = addr

    def remove_host(self, model: str, host: str) -> None:
        r = self.model(model)
        r.hosts.pop(host, None)
        r.ready = {(h, v) for h, v in r.ready if h != host}

    def add_version(self, model: str, version: str) -> None:
        self.models.setdefault(model, ModelRoute()).weights.setdefault(version, 0.0)

    def set_ready(self, model: str, host: str, version: str, ready: bool) -> None:
        r = self.model(model)
        if ready and host in r.hosts and version in r.weights:
            r.ready.add((host, version))
        else:
            r.ready.discard((host, version))

    def set_weights(self, model: str, weights: dict[str, float]) -> None:
        """Refuses (WeightRefused) any split the ready capacity cannot carry."""
        r = self.model(model)
        if not weights or any(not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0
                              for w in weights.values()):
            raise WeightRefused("weights must be a non-empty map of version to finite non-negative numbers")
        unknown = set(weights) - set(r.weights)
        if unknown:
            raise UnknownVersion(f"unknown versions {sorted(unknown)}; register them first")
        total = sum(weights.values())
        if total <= 0:
            raise WeightRefused("at least one version needs a positive weight")
        live = {v for v, w in weights.items() if w > 0}
        capacity = len({h for h, v in r.ready if v in live and h in r.hosts})
        for v in live:
            need = weights[v] / total * capacity
            have = len(r.ready_hosts(v))
            if have == 0 or need > have + self.slack:
                raise WeightRefused(f"version {v} would take {weights[v] / total:.1%} of the traffic "
                                    f"(~{need:.2f} hosts' worth) but only {have} of {capacity} ready hosts serve it")
        r.weights.update({v: 0.0 for v in r.weights})
        r.weights.update({v: float(w) for v, w in weights.items()})

    # ---------------------------------------------------------------- decisions
    def route(self, model: str, version: str | None = None, exclude: set[str] = frozenset()) -> tuple[str, str, str]:
        """(host, address, version) for one request; never a host not ready for that version."""
        r = self.model(model)
        if version is not None:
            if version not in r.weights:
                raise UnknownVersion(f"model {model!r} has no version {version!r}")
            hosts = [h for h in r.ready_hosts(version) if h not in exclude]
            if not hosts:
                raise NoReadyHost(f"no host is ready for {model} {version}")
            h = self.rng.choice(hosts)
            return h, r.hosts[h], version
        choices = [(v, w) for v, w in sorted(r.weights.items())
                   if w > 0 and any(h not in exclude for h in r.ready_hosts(v))]
        if not choices:
            raise NoReadyHost(f"no host is ready for any weighted version of {model}")
        x = self.rng.random() * sum(w for _, w in choices)
        for v, w in choices:
            x -= w
            if x <= 0:
                break
        hosts = [h for h in r.ready_hosts(v) if h not in exclude]
        h = self.rng.choice(hosts)
        return h, r.hosts[h], v
