"""The simulator drives the real policy over a slotted link model."""
from bench.sim import SimConfig, analytic_baselines, simulate


def test_brief_baselines():
    b = analytic_baselines(200, 400e9, 10e9 / 8, 10e9 / 8)
    assert b["lower_bound_s"] == 320
    assert round(b["naive_pull_s"] / 3600, 1) == 17.8       # ~18 h
    assert round(b["binary_tree_s"] / 60) == 75             # ~75 min


def test_small_swarm_with_failures_completes_with_one_origin_copy():
    cfg = SimConfig(hosts=40, size=40 * 64 * 2**20, racks=4, fail_fraction=0.1, seeders=4, have_interval=0.25)
    r = simulate(cfg)
    assert r["survivors"] == 36 and r["died"] == 4
    assert r["origin_copies"] <= 1.1
    assert r["max_s"] >= r["lower_bound_s"]
    assert r["naive_over_swarm"] > 1 and r["tree_over_swarm"] > 1
    assert simulate(cfg)["max_s"] == r["max_s"]             # seeded: reproducible
