"""The benchmark and simulator commands through the CLI, at toy sizes (numbers are not asserted)."""
import json
import tempfile

import pytest

from weightcast.cli import main


def test_bench_load_reports_both_throughputs(capsys):
    assert main(["bench", "load", "--size", "4M", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["size_bytes"] >= 4 << 20 and r["pagecache_read_gbps"] > 0 and r["load_gbps"] > 0
    # the load's own ceiling is measured in the same run, and the ratios to both bounds are reported
    assert r["hash_core_gbps"] > 0 and r["hash_threads"] >= 1 and r["hash_bound_gbps"] > 0
    assert r["load_over_read"] > 0 and r["load_over_hash_bound"] > 0


def test_sim_prints_the_swarm_against_a_naive_pull_and_a_bound(capsys):
    assert main(["sim", "--hosts", "30", "--size", "30GB", "--chunk", "1GB", "--racks", "3",
                 "--seeders", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["survivors"] + r["died"] == 30
    assert r["max_s"] >= r["lower_bound_s"] and r["naive_pull_s"] == 30 * r["lower_bound_s"]
    assert 0.99 <= r["origin_copies"] <= 1.2
    assert r["config"]["max_uploads"] == 8 and r["config"]["policy"]["window"] == 1024   # peerd's defaults


def test_sim_runs_the_policy_objects_with_peerd_flags(capsys):
    assert main(["sim", "--engine", "policies", "--hosts", "12", "--size", "1GB", "--chunk", "32MB", "--racks", "2",
                 "--seeders", "2", "--fail", "0", "--max-uploads", "4", "--rack-rescue-s", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["survivors"] == 12 and r["ratio"] >= 1.0 and r["origin_copies"] == 1.0
    # it models no uplinks, so an oversubscribed rack would come out faster than its uplink allows: refused
    assert main(["sim", "--engine", "policies", "--hosts", "8", "--racks", "4", "--oversubscription", "4"]) == 2
    assert "use --engine fleet" in capsys.readouterr().err


@pytest.mark.usefixtures("rank_zygote")          # the demo's host workers fork their rank servers from it
def test_demo_end_to_end():
    import asyncio

    import aiohttp

    from weightcast.demo import run_demo
    seen = {}

    async def hold(res):      # what `make demo` waits in (for Enter): the printed UI link must answer
        async with aiohttp.ClientSession() as s:
            async with s.get(res["temporal_ui"]) as r:
                seen["ui_status"] = r.status
    res = asyncio.run(run_demo(hosts=3, size=8 << 20, rate=32 << 20, progress=None, hold=hold, train_steps=150))
    assert seen["ui_status"] == 200
    assert res["ok"] and res["hosts_ready"] == ["h0", "h1", "h2"]
    assert res["inference"]["matches_reference_weights"] and res["traffic"] == {res["inference"]["model_version"]: 100}
    # the training prologue: a Llama on real text, a rank killed halfway and recovered, learning visibly
    t = res["training"]
    assert t["steps"] == 150 and t["killed_rank_at_step"] >= 75 and len(t["recoveries"]) == 1
    assert "rank 1 on h1" in t["recoveries"][0] and t["resumed_from"][-1] > 0
    assert t["held_out_loss"] < t["held_out_loss_start"] - 1.5
    # its Hugging Face export, rolled out by the chain to two hosts, answers the openai client with the
    # golden completion recorded at publish, and writes greedy text
    hf = res["hf"]
    assert hf["hosts_ready"] == ["h0", "h1"] and hf["openai_completion"]["matches_golden"]
    assert hf["openai_completion"]["text"] and len(hf["greedy"]) == 3 and all(g["text"] for g in hf["greedy"])


def test_bench_swarm_with_a_killed_and_a_corrupt_host(capsys):
    rc = main(["bench", "swarm", "--hosts", "4", "--size", "6M", "--rate", "4M", "--chunk", "256K",
               "--kill", "1", "--corrupt-peers", "1", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["all_verified"] and r["corrupt_chunks_accepted"] == 0 and not r["failed"]
    assert len(r["killed"]) == 1 and r["corrupt_peers"] == ["h1"]
    assert r["lower_bound_s"] == 1.5 and r["max_s"] >= r["p50_s"] and r["ratio"] >= 1.0   # 6 MiB at 4 MiB/s
    assert 0.99 <= r["origin_copies"] and r["origin_done_s"] is not None
    assert r["origin_done_s"] <= r["max_s"] and r["tail_s"] >= 0
    # where the CPU went: the surviving daemons' own time, and the bitmap pushes they sent
    assert 0 < r["peerd_cores"] <= r["machine_cores"] and r["gossip_sent_per_host_s"] > 0
    # and per GiB: the daemons per copy received, the origin (SeaweedFS) per GiB it served
    assert r["peerd_cpu_s_per_gib_received"] > 0 and r["origin_cpu_s"] > 0 and r["origin_cpu_s_per_gib_served"] > 0


def test_bench_rollout_reports_where_the_time_goes(capsys):
    assert main(["bench", "rollout", "--hosts", "2", "--size", "4M", "--rate", "32M", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] and r["hosts"] == 2 and r["lower_bound_s"] > 0 and r["bytes"] >= 4 << 20
    assert r["rollout_s"] > r["swarm_s"] > 0 and r["overhead_s"] > 0
    assert {"manifest", "distribute", "load"} <= set(r["phase_seconds"])


def _pid_of(needle: str) -> int | None:
    import os
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read().replace(b"\0", b" "):
                    return int(pid)
        except OSError:
            continue
    return None


def test_bench_says_which_daemon_died_how_and_its_last_words(tmp_path):
    """A daemon that dies on its own (here: SIGSEGV from outside, standing in for a native crash) is
    reported with its exit signal and log tail (faulthandler's dump), and the run still ends."""
    import asyncio
    import os
    import signal

    from bench.swarm import SwarmBenchConfig, run_swarm_bench
    cfg = SwarmBenchConfig(hosts=3, size=6 << 20, rate=2 << 20, chunk=256 << 10, timeout=60, workdir=tmp_path / "w")
    shot = []

    def progress(now, done, total):
        if not shot and done > 0:
            pid = _pid_of(f"--id h2 --store {tmp_path}")
            assert pid, "peerd h2 not found"
            os.kill(pid, signal.SIGSEGV)
            shot.append(pid)

    r = asyncio.run(run_swarm_bench(cfg, progress=progress))
    assert shot and set(r["crashed"]) == {"h2"} and not r["all_verified"]
    death = r["crashed"]["h2"]
    assert death["how"] == "signal SIGSEGV"
    assert any("Segmentation fault" in line or "Fatal Python error" in line for line in death["last_log_lines"])
    assert not r["timed_out"] and sorted(r["incomplete"]) == []     # the two living hosts finished
    assert _pid_of(str(tmp_path / "w")) is None                      # nothing left running


def test_a_benchmark_stopped_by_sigterm_leaves_no_process_behind(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "weightcast.cli", "bench", "swarm", "--hosts", "3", "--size", "64M",
                             "--rate", "4M", "--json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while _pid_of(f"--store {tmp_path}") is None:         # wait until its daemons run
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    deadline = time.monotonic() + 20
    while _pid_of(str(tmp_path)) is not None:             # peerd and SeaweedFS gone with it
        assert time.monotonic() < deadline, "a process of the benchmark outlived it"
        time.sleep(0.2)


def test_demo_has_a_deadline_and_says_where_it_stood():
    import asyncio

    import pytest

    from weightcast.demo import DemoFailed, run_demo
    with pytest.raises(DemoFailed) as e:
        asyncio.run(run_demo(hosts=2, size=4 << 20, rate=1 << 20, progress=None, ui=False, deadline_s=0.01))
    report = json.loads(str(e.value))
    # the host list travels by reference: until the control worker has read it, the rollout lists no hosts
    assert report["phase"] and "detail" in report and report["dead"] == []
    assert set(report["hosts"]) <= {"h0", "h1"}


def test_bench_throughput_reports_cost_per_byte(capsys):
    """Toy size: every downloader gets the whole version from the serving peer alone, and the CPU
    accounting is there (the numbers themselves are not asserted)."""
    # BLAKE3 chunk digests (the cheaper manifest choice): seeded from S3, served, verified by real peerds
    # big enough that serving it takes several of /proc's 10 ms CPU ticks (one sendfile a chunk is cheap)
    assert main(["bench", "throughput", "--size", "96M", "--chunk", "4M", "--downloaders", "2", "--hash", "blake3",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["hash_algorithm"] == "blake3"
    assert r["chunks"] == 24 and not r["failed"] and len(r["downloaders_detail"]) == 2
    for d in r["downloaders_detail"]:
        assert d["from_peer_bytes"] == r["size"] and d["mib_per_s"] > 0 and d["cpu_s_per_gib_received"] > 0
        # the stages peerd meters itself (peerd_store_cpu_seconds_total) are reported
        st = d["stages_cpu_s_per_gib"]
        assert st["hash"] > 0 and st["write"] > 0 and st["allocate"] >= 0
    assert r["server"]["cpu_s_per_gib_sent"] > 0 and r["hash_cpu_s_per_gib"] > 0
    fl = r["floors_cpu_s_per_gib"]
    assert all(fl[k] > 0 for k in ("hash", "write", "receive", "write_cold")) and fl["allocate"] >= 0
    assert fl["total"] > 0
    assert sorted(fl["write_two_writers_one_file"]) == ["locked", "unlocked"]
    assert all(v > 0 for v in fl["write_two_writers_one_file"].values())
    assert r["downloader_cpu_over_floor_total"] > 0
    # the event loop's own thread is a part of the process (never more than all of it)
    for d in r["downloaders_detail"]:
        assert 0 <= d["loop_thread_cpu_s_per_gib"] <= d["cpu_s_per_gib_received"]
    # a swarm host's figure: one copy received and one served, so at least the serving side's cost
    assert r["host_cpu_s_per_gib_received_and_served"] >= r["server"]["cpu_s_per_gib_sent"]


def test_bench_receive_compares_both_receive_paths(capsys):
    assert main(["bench", "receive", "--size", "2M", "--count", "3", "--rounds", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for way in ("aiohttp", "chunk_fetch"):
        assert len(r[way]["cpu_s_per_gib_all"]) == 2 and r[way]["cpu_s_per_gib"] > 0 and r[way]["mib_per_s"] > 0
    assert r["chunk_fetch_over_aiohttp_cpu"] > 0


def test_bench_gossip_times_both_push_transports_against_a_real_peerd(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "gossip", "--exchanges", "150", "--rounds", "2", "--peers", "5", "--json"]) == 0
    assert list(tmp_path.iterdir()) == []                    # its peerd's store and key are gone
    r = json.loads(capsys.readouterr().out)
    assert r["exchanges_per_round"] == 150
    for way in ("http", "have"):
        assert len(r[way]["total_ms_all"]) == 2 and r[way]["client_ms"] > 0 and r[way]["total_ms"] > 0
    assert r["have_over_http"] > 0


def test_bench_engine_reports_a_verified_reload_against_a_cold_start(capsys):
    assert main(["bench", "engine", "--engine", "transformers", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["golden_ok"] and r["cold_start_s"] > 0 and r["reload_s"] > 0 and r["reload_over_cold"] > 0


def test_bench_router_times_the_first_token_on_both_paths(capsys):
    assert main(["bench", "router", "--engine", "transformers", "--requests", "6", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] == 6 and set(r["ttft_p50_ms"]) == {"direct", "router"}
    assert all(v > 0 for v in r["ttft_p50_ms"].values()) and r["router_over_direct_p50"] > 0


def test_gpu_check_says_clearly_that_there_is_no_cuda(capsys):
    import torch
    if torch.cuda.is_available():                  # on a GPU host the check runs for real (make gpu-check)
        return
    assert main(["gpu-check"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert r["ok"] is False and r["error"].startswith("no CUDA device")
