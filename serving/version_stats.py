"""Per-version request outcomes and latencies over a sliding window, for canary analysis: the rollout
compares the new version with the old one on the same traffic before each next step."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 600.0
MAX_SAMPLES = 100_000        # per (model, version): bounded memory whatever the request rate


@dataclass
class VersionStats:
    samples: dict[tuple[str, str], deque] = field(default_factory=dict)

    def record(self, model: str, version: str, ok: bool, seconds: float, now: float | None = None) -> None:
        q = self.samples.setdefault((model, version), deque(maxlen=MAX_SAMPLES))
        q.append((time.monotonic() if now is None else now, ok, seconds))

    def summary(self, model: str, since_s: float, now: float | None = None) -> dict[str, dict]:
        """{version: {requests, errors, error_rate, p50_ms, p99_ms}} over the last ``since_s`` seconds."""
        now = time.monotonic() if now is None else now
        since_s = min(since_s, WINDOW_S)
        out = {}
        for (m, v), q in self.samples.items():
            if m != model:
                continue
            while q and q[0][0] < now - WINDOW_S:      # forget what no window can ask for
                q.popleft()
            recent = [(ok, s) for t, ok, s in q if t >= now - since_s]
            if not recent:
                continue
            lat = sorted(s for _, s in recent)
            errors = sum(1 for ok, _ in recent if not ok)
            out[v] = {"requests": len(recent), "errors": errors, "error_rate": round(errors / len(recent), 4),
                      "p50_ms": round(1000 * _quantile(lat, 0.50), 2), "p99_ms": round(1000 * _quantile(lat, 0.99), 2)}
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
