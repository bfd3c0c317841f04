"""The benchmark and simulator commands through the CLI, at toy sizes (numbers are not asserted)."""
import json

from weightcast.cli import main


def test_bench_load_reports_both_throughputs(capsys):
    assert main(["bench", "load", "--size", "4M", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["size_bytes"] >= 4 << 20 and r["pagecache_read_gbps"] > 0 and r["load_gbps"] > 0
    assert abs(r["load_over_read"] - r["load_gbps"] / r["pagecache_read_gbps"]) < 0.01 * r["load_over_read"] + 2e-3


def test_sim_prints_the_brief_comparison(capsys):
    assert main(["sim", "--hosts", "30", "--size", "30GB", "--chunk", "1GB", "--racks", "3",
                 "--seeders", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["survivors"] + r["died"] == 30
    assert r["max_s"] >= r["lower_bound_s"] and r["naive_pull_s"] == 30 * r["lower_bound_s"]
    assert 0.99 <= r["origin_copies"] <= 1.2


def test_demo_end_to_end():
    import asyncio

    from weightcast.demo import run_demo
    res = asyncio.run(run_demo(hosts=3, size=8 << 20, rate=32 << 20, progress=None))
    assert res["ok"] and res["hosts_ready"] == ["h0", "h1", "h2"]
    assert res["inference"]["matches_reference_weights"] and res["traffic"] == {res["inference"]["model_version"]: 100}
