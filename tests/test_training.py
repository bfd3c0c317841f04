"""The training room through its real interface: rank processes spawned by `launch`, real gloo process
groups on loopback, the real reference transformer and the synthetic language."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from serving.model import init_model
from training.config import ConfigError, TrainConfig
from training.data import Language, Sampler
from lib.netns import PAYLOAD_SHARE, made_here
from training.launch import RanksHung, launch
from weightcast.cli import main

SMALL = ["model.vocab=128", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.max_seq=16",
         "seq_len=16", "global_batch=8", "lr=3e-2"]


def run(tmp_path, name, *overrides):
    # a hang ends with every rank's stacks on stderr before pytest's own timeout
    return launch(TrainConfig.load(None, [*SMALL, *overrides]), tmp_path / name, timeout_s=240)


def test_ranks_that_do_not_finish_are_stopped_with_their_stacks(tmp_path, capfd):
    cfg = TrainConfig.load(None, [*SMALL, "layout=ddp", "world_size=2", "steps=1000", 'slow_ranks={"1": 100}'])
    with pytest.raises(RanksHung, match="still running after 6 s"):
        launch(cfg, tmp_path / "run", timeout_s=6)
    err = capfd.readouterr().err
    assert "most recent call first" in err and "run_rank" in err   # faulthandler: where each rank was


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    # one thread, like each rank of the runs it is compared with: the reference's sums come out the same
    # however loaded the machine is (a two-thread reference once came out 1.2e-4 away from every layout)
    res = launch(TrainConfig.load(None, [*SMALL, "model.n_layers=4", "layout=single", "world_size=1", "steps=20",
                                         "cpu_threads=1"]), d / "run")
    weights = torch.load(d / "run" / "model.pt")
    weights["__bytes__"] = sum(v.numel() * v.element_size() for v in weights.values())   # fp32 gradient size
    return res, weights


@pytest.mark.parametrize("overrides", [
    ["layout=ddp"], ["layout=fsdp"], ["layout=tp"],
    ["layout=pp", "pp_schedule=gpipe"], ["layout=pp", "pp_schedule=1f1b", "world_size=4", "microbatches=4"],
    ["layout=fsdp_tp", "world_size=4", "tp_degree=2"],
    ["layout=ddp", "overlap=false", "bucket_mb=0.01"],
    # rank 1 three times slower: it gets fewer samples, and the weighted gradient is still the batch mean
    ["layout=ddp", "rebalance=true", 'slow_ranks={"1": 3}'],
], ids=lambda o: ",".join(o))
def test_every_layout_matches_a_single_process_over_20_steps(tmp_path, single_run, overrides):
    """fp32: a layout changes only the order in which sums are formed (per-rank partial sums averaged
    by an all-reduce, row-parallel partial products, microbatch gradients accumulated), ~1e-7 relative
    per step; AdamW divides by sqrt of tiny second moments and carries that along (observed 1e-6 on
    losses, 3e-5 on parameters). Tolerance: 1e-4 absolute on every step's loss and every final parameter."""
    single, a = single_run
    a = {k: v for k, v in a.items() if k != "__bytes__"}
    res = launch(TrainConfig.load(None, [*SMALL, "model.n_layers=4", "world_size=2", "steps=20", *overrides]),
                 tmp_path / "run")
    b = torch.load(tmp_path / "run" / "model.pt")
    assert max(abs(x - y) for x, y in zip(single["losses"], res["losses"])) < 1e-4
    assert set(a) == set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert single["losses"][-1] < single["losses"][0] - 0.3       # and it learns
    if "overlap=false" in overrides:       # one reduction after backward, not one per bucket as well
        assert res["sent_bytes_per_step_per_rank"] == single_run[1]["__bytes__"]
    if "rebalance=true" in overrides:
        fast, slow = res["samples_per_step_by_rank"]
        assert fast + slow == 8 and slow < fast, res["samples_per_step_by_rank"]


# local_sgd / diloco send the whole model (as many bytes as one all-reduce of the gradients) once every
# 8 steps: 5 of the 38 steady steps (2..39) the summary averages. powersgd (rank 2) sends (n+m)*2 numbers
# per n x m matrix and every vector whole: 0.244 of the gradient for this model (computed from its shapes)
@pytest.mark.parametrize("comm,ratio_to_allreduce", [("fp16", 0.5), ("int8_ef", 0.25), ("topk_ef", 0.1),
                                                      ("powersgd", None), ("local_sgd", 5 / 38),
                                                      ("diloco", 5 / 38)])
def test_compressed_methods_learn_and_send_fewer_bytes(tmp_path, comm, ratio_to_allreduce):
    base = run(tmp_path, "base", "steps=40")
    res = run(tmp_path, comm, f"comm={comm}", "topk_ratio=0.05", "sync_every=8", "steps=40")
    assert res["loss_last"] < res["loss_first"] - 0.5, res["losses"]
    ratio = res["sent_bytes_per_step_per_rank"] / base["sent_bytes_per_step_per_rank"]
    if ratio_to_allreduce is None:                                # powersgd: from the model's shapes
        shapes = [p.shape for p in init_model(TrainConfig.load(None, SMALL).model, 0).parameters()]
        low = sum((s[0] + s[1]) * 2 if len(s) == 2 and min(s) > 2 else s.numel() for s in shapes)
        ratio_to_allreduce = low / sum(s.numel() for s in shapes)
    assert ratio == pytest.approx(ratio_to_allreduce, rel=0.05), ratio   # counted at the process group, per step


def assert_resumes_exactly(source, seq_len: int, world: int) -> None:
    """4 steps of 6 samples split over ``world`` ranks, checkpointed and resumed in a new sampler after
    step 2, take exactly samples 0..23 in order."""
    whole = source.samples(0, 4 * 6, seq_len)
    s = Sampler(source, global_batch=6, seq_len=seq_len)
    seen = []
    for step in range(4):
        if step == 2:                                  # checkpoint and resume in a new sampler
            state = s.state_dict()
            s = Sampler(source, global_batch=6, seq_len=seq_len)
            s.load_state_dict(state)
        seen += [s.batch(r, world) for r in range(world)]
        s.advance()
    assert torch.equal(torch.cat(seen), whole)


def test_the_sampler_neither_repeats_nor_skips_across_a_resume():
    assert_resumes_exactly(Language(64, seed=5), 12, 3)


def test_bad_configs_are_refused_before_any_process_starts(tmp_path, capsys):
    for overrides, words in [(["world_size=3"], "not divisible"), (["model.n_heads=3"], "does not divide"),
                             (["comm=powersgd2"], "comm 'powersgd2'"), (["layot=ddp"], "did you mean layout"),
                             (["model.d_modle=64"], "did you mean model.d_model"), (["steps=0"], "steps must be"),
                             (["layout=single"], "runs one process"),
                             (["layout=fsdp", "comm=int8_ef"], "DDP gradient method"),
                             (["layout=tp", "world_size=4"], "degree 4 does not divide model.n_heads=2"),
                             (["layout=fsdp_tp", "world_size=6", "tp_degree=4"], "not divisible by tp_degree 4"),
                             (["layout=pp", "world_size=4"], "n_layers >= 4"),
                             (["layout=pp", "microbatches=3"], "3 equal microbatches"),
                             (["layout=pp", "pp_schedule=zb"], "pp_schedule 'zb'"),
                             (["layout=tp", "rebalance=true"], "rebalance sizes data-parallel shares"),
                             (['slow_ranks={"5": 2}'], "ranks are 0..1"),
                             (["layout=tp", "overlap=false"], "overlap=false"),
                             (["overlap=maybe"], "overlap must be true or false")]:
        with pytest.raises(ConfigError, match=words):
            TrainConfig.load(None, [*SMALL, *overrides])
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"layout": "ddp", "world_size": 2, "global_batch": 7}))
    assert main(["train", "run", str(cfg)]) == 2
    assert "not divisible" in capsys.readouterr().err


def test_train_run_through_the_cli(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('layout = "ddp"\nworld_size = 2\nsteps = 6\ncomm = "int8_ef"\n[model]\nvocab = 64\nd_model = 32\n'
                   'n_heads = 2\nd_ff = 64\nmax_seq = 16\n')
    assert main(["train", "run", str(cfg), "--set", "seq_len=16", "--set", "global_batch=4", "--set", "log_every=2",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["comm"] == "int8_ef" and out["world_size"] == 2 and out["steps"] == 6
    assert out["sent_bytes_per_step_per_rank"] > 0 and out["tokens_per_s"] > 0
    # live progress while it ran: every log_every steps, with the loss the run reports for that step
    lines = [line for line in captured.err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"], captured.err
    assert all("tokens/s" in line and "ETA" in line for line in lines)
    assert "ETA 0 s" in lines[-1]
    out_dir = Path(out["out_dir"])              # the run's own directory, kept for its user: the weights are there
    assert (out_dir / "model.pt").is_file()
    shutil.rmtree(out_dir)


def test_bench_allreduce_runs_every_method_on_a_rate_limited_link(capsys):
    """Through the CLI, each rank in its own network namespace behind a tc-shaped link (toy size: the
    numbers are not asserted, only what each row must hold)."""
    tiny = ["model.vocab=64", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=1"]
    argv = ["bench", "allreduce", "--ranks", "2", "--link", "400Mbit", "--steps", "4", "--json"]
    assert main([*argv, *[x for kv in tiny for x in ("--set", kv)]]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {row["method"]: row for row in r["methods"]}
    assert set(rows) == {"allreduce", "allreduce_no_overlap", "allreduce_bucket_1mb", "fp16", "int8_ef", "topk_ef",
                         "powersgd", "local_sgd", "diloco"}
    assert rows["allreduce"]["bytes_vs_allreduce"] == 1 and rows["fp16"]["bytes_vs_allreduce"] == 0.5
    assert rows["allreduce_no_overlap"]["bytes_vs_allreduce"] == 1 and rows["powersgd"]["bytes_vs_allreduce"] < 0.5
    assert rows["int8_ef"]["bytes_vs_allreduce"] < 0.26 and rows["topk_ef"]["bytes_vs_allreduce"] < 0.03
    assert r["link_bytes_per_s"] == 50e6 and r["ring_bound_s"] == round(r["gradient_bytes"] / 50e6, 4)
    assert r["ring_bound_payload_s"] == round(r["gradient_bytes"] / (50e6 * PAYLOAD_SHARE), 4)   # headers aside
    assert r["busbw_over_ring_bound"] > 0
    assert not made_here()        # the ranks' namespaces are gone
    assert all(row["step_s_median"] > 0 for row in rows.values())
    # the held-out loss, evaluated along the way: plain all-reduce reaches its own target when it is there
    assert rows["allreduce"]["eval_loss_after_steps"] == r["eval_target_loss"]
    assert rows["allreduce"]["speedup_to_eval_target"] == 1 and all(row["eval_loss_after_steps"] > 0 for row in rows.values())


def test_bench_rebalance_gives_the_slow_rank_less_and_keeps_the_same_training(capsys):
    """Toy size through the CLI: the slowed rank's share shrinks only when rebalancing, and the three runs
    train identically (the weighted gradient is the batch mean whatever the shares). Times not asserted."""
    tiny = ["model.vocab=64", "model.d_model=32", "model.n_heads=2", "model.d_ff=64"]
    assert main(["bench", "rebalance", "--steps", "6", "--batch-per-rank", "4", "--slowdown", "3", "--json",
                 "--link", "400Mbit",
                 *[x for kv in tiny for x in ("--set", kv)]]) == 0
    r = json.loads(capsys.readouterr().out)
    runs = r["runs"]
    assert runs["balanced"]["samples_per_step_by_rank"] == [4, 4] == runs["slow_equal_shares"]["samples_per_step_by_rank"]
    fast, slow = runs["slow_rebalanced"]["samples_per_step_by_rank"]
    assert slow < fast and fast + slow == 8
    assert runs["slow_rebalanced"]["loss_last"] == pytest.approx(runs["balanced"]["loss_last"], abs=1e-4)
    assert r["ideal_vs_balanced"] == round(2 / (1 + 1 / 3), 4)
    assert r["link_bytes_per_s"] == 50e6 and not made_here()


def test_bench_train_reports_every_layout(capsys):
    tiny = ["model.vocab=64", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=2",
            "global_batch=4"]
    assert main(["bench", "train", "--layouts", "single,tp,pp", "--steps", "3", "--json",
                 *[x for kv in tiny for x in ("--set", kv)]]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [row["layout"] for row in r["layouts"]] == ["single", "tp", "pp"]
    assert all(row["tokens_per_s"] > 0 for row in r["layouts"])
    losses = {row["loss_last"] for row in r["layouts"]}
    assert max(losses) - min(losses) < 1e-3                      # the same training, whatever the layout
    assert main(["bench", "train", "--layouts", "tp", "--ranks", "3", "--json"]) == 2   # refused before it starts
