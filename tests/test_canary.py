"""The canary judgment (pure) and the router's per-version window it reads."""
import pytest

from activities.canary import judge
from serving.version_stats import VersionStats
from workflows.types import AnalysisConfig, RolloutInput

CFG = AnalysisConfig(min_requests=10, max_error_rate=0.05, max_error_rate_increase=0.01, max_p99_ratio=1.5)


def numbers(requests, errors, p99):
    return {"requests": requests, "errors": errors, "error_rate": errors / requests, "p50_ms": p99 / 2, "p99_ms": p99}


def test_judgments():
    base = numbers(100, 1, 10.0)
    assert judge(numbers(5, 0, 10.0), base, CFG).verdict == "inconclusive"
    assert judge(None, base, CFG).verdict == "inconclusive"
    assert judge(numbers(100, 1, 12.0), base, CFG).verdict == "pass"
    r = judge(numbers(100, 3, 10.0), base, CFG)               # 3 % < 5 % ceiling, but +2 % over the baseline
    assert r.verdict == "fail" and "error rate 3.00% vs 1.00%" in r.reason
    r = judge(numbers(100, 0, 21.0), base, CFG)
    assert r.verdict == "fail" and "p99 latency 21.0 ms vs 10.0 ms" in r.reason
    # x1.6 but only +6 ms: within the slack a short window's p99 needs (one slow request moves it)
    assert judge(numbers(100, 0, 16.0), base, CFG).verdict == "pass"
    small = numbers(100, 0, 3.3)
    assert judge(numbers(100, 0, 10.3), small, CFG).verdict == "pass"      # x3 of a tiny p99, +7 ms
    tight = AnalysisConfig(min_requests=10, max_p99_ratio=1.5, min_p99_increase_ms=0)
    assert judge(numbers(100, 0, 16.0), base, tight).verdict == "fail"
    assert judge(numbers(100, 6, 99.0), None, CFG).verdict == "fail"     # no baseline: the ceiling still holds
    assert judge(numbers(100, 0, 99.0), None, CFG).verdict == "pass"


def test_version_stats_window():
    st = VersionStats()
    for i in range(100):
        st.record("m", "v2", ok=i % 10 != 0, seconds=0.001 * (i + 1), now=1000.0 + i * 0.1)
    st.record("m", "v1", ok=True, seconds=0.5, now=500.0)        # long ago: outside every window asked
    s = st.summary("m", since_s=5.0, now=1010.0)
    assert set(s) == {"v2"} and s["v2"]["requests"] == 50 and s["v2"]["errors"] == 5
    assert s["v2"]["p99_ms"] == pytest.approx(100.0) and st.summary("other", 5.0, now=1010.0) == {}


def test_bad_analysis_settings_are_refused():
    bad = RolloutInput("m", "v1", "{}", {"endpoint": "e", "bucket": "b", "prefix": "p"}, [],
                       analysis=AnalysisConfig(interval_s=0, max_error_rate=2.0, min_requests=-1,
                                               min_p99_increase_ms=-1))
    problems = " ".join(bad.problems())
    assert "analysis.interval_s must be a positive number" in problems
    assert "analysis.max_error_rate is a fraction" in problems and "analysis.min_requests" in problems
    assert "analysis.min_p99_increase_ms must be a number >= 0" in problems
    assert "analysis compares versions through the router" in problems
