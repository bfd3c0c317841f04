"""Canary judgment: the new version's numbers against the previous version's over the same window
(pure: the activity fetches the numbers from the router, this decides)."""
from __future__ import annotations

from workflows.types import AnalysisConfig, AnalysisResult


def judge(new: dict | None, base: dict | None, cfg: AnalysisConfig) -> AnalysisResult:
    new, base = new or {}, base or {}
    if new.get("requests", 0) < max(1, cfg.min_requests):
        return AnalysisResult("inconclusive", f"{new.get('requests', 0)} requests reached the new version "
                                              f"(at least {cfg.min_requests} needed)", new, base)
    failures = []
    if new["error_rate"] > cfg.max_error_rate:
        failures.append(f"error rate {new['error_rate']:.2%} > ceiling {cfg.max_error_rate:.2%}")
    if base.get("requests"):
        if new["error_rate"] > base["error_rate"] + cfg.max_error_rate_increase:
            failures.append(f"error rate {new['error_rate']:.2%} vs {base['error_rate']:.2%} on the previous version "
                            f"(allowed +{cfg.max_error_rate_increase:.2%})")
        if base["p99_ms"] > 0 and new["p99_ms"] > cfg.max_p99_ratio * base["p99_ms"] \
                and new["p99_ms"] - base["p99_ms"] > cfg.min_p99_increase_ms:
            failures.append(f"p99 latency {new['p99_ms']:.1f} ms vs {base['p99_ms']:.1f} ms on the previous version "
                            f"(allowed x{cfg.max_p99_ratio}, or +{cfg.min_p99_increase_ms:g} ms)")
    if failures:
        return AnalysisResult("fail", "; ".join(failures), new, base)
    return AnalysisResult("pass", f"{new['requests']} requests, error rate {new['error_rate']:.2%}, "
                                  f"p99 {new['p99_ms']:.1f} ms" + (f" (previous: {base['error_rate']:.2%}, "
                                                                    f"{base['p99_ms']:.1f} ms)" if base else ""),
                          new, base)
