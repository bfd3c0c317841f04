"""The training room through its real interface: rank processes spawned by `launch`, real gloo process
groups on loopback, the real reference transformer and the synthetic language."""
import json

import pytest
import torch

from training.config import ConfigError, TrainConfig
from training.data import Language, Sampler
from training.launch import launch
from weightcast.cli import main

SMALL = ["model.vocab=128", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.max_seq=16",
         "seq_len=16", "global_batch=8", "lr=3e-2"]


def run(tmp_path, name, *overrides):
    return launch(TrainConfig.load(None, [*SMALL, *overrides]), tmp_path / name)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_data_parallel_layouts_match_a_single_process_over_20_steps(tmp_path, layout):
    """fp32: the two runs differ only in the order gradients are summed (two rank partial sums averaged
    by the all-reduce vs one sum over the batch), ~1e-7 relative per step; AdamW carries that along.
    Tolerance: 1e-4 absolute on every step's loss and every final parameter, ~1,000x the observed gap."""
    single = run(tmp_path, "single", "layout=single", "world_size=1", "steps=20")
    dp = run(tmp_path, layout, f"layout={layout}", "world_size=2", "steps=20")
    assert max(abs(a - b) for a, b in zip(single["losses"], dp["losses"])) < 1e-4
    a, b = torch.load(tmp_path / "single" / "model.pt"), torch.load(tmp_path / layout / "model.pt")
    assert set(a) == set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert single["losses"][-1] < single["losses"][0] - 0.3       # and it learns


# local_sgd sends the whole model (as many bytes as one all-reduce of the gradients) once every 8 steps:
# 5 of the 38 steady steps (2..39) the summary averages
@pytest.mark.parametrize("comm,ratio_to_allreduce", [("fp16", 0.5), ("int8_ef", 0.25), ("topk_ef", 0.1),
                                                      ("local_sgd", 5 / 38)])
def test_compressed_methods_learn_and_send_fewer_bytes(tmp_path, comm, ratio_to_allreduce):
    base = run(tmp_path, "base", "steps=40")
    res = run(tmp_path, comm, f"comm={comm}", "topk_ratio=0.05", "sync_every=8", "steps=40")
    assert res["loss_last"] < res["loss_first"] - 0.5, res["losses"]
    ratio = res["sent_bytes_per_step_per_rank"] / base["sent_bytes_per_step_per_rank"]
    assert ratio == pytest.approx(ratio_to_allreduce, rel=0.05), ratio   # counted at the process group, per step


def test_the_sampler_neither_repeats_nor_skips_across_a_resume():
    lang = Language(64, seed=5)
    whole = lang.samples(0, 4 * 6, 12)
    s = Sampler(lang, global_batch=6, seq_len=12)
    seen = []
    for step in range(4):
        if step == 2:                                  # checkpoint and resume in a new sampler
            state = s.state_dict()
            s = Sampler(lang, global_batch=6, seq_len=12)
            s.load_state_dict(state)
        seen += [s.batch(r, 3) for r in range(3)]
        s.advance()
    assert torch.equal(torch.cat(seen), whole)


def test_bad_configs_are_refused_before_any_process_starts(tmp_path, capsys):
    for overrides, words in [(["world_size=3"], "not divisible"), (["model.n_heads=3"], "does not divide"),
                             (["comm=powersgd2"], "comm 'powersgd2'"), (["layot=ddp"], "did you mean layout"),
                             (["model.d_modle=64"], "did you mean model.d_model"), (["steps=0"], "steps must be"),
                             (["layout=single"], "runs one process"),
                             (["layout=fsdp", "comm=int8_ef"], "DDP gradient hook")]:
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
    assert main(["train", "run", str(cfg), "--set", "seq_len=16", "--set", "global_batch=4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["comm"] == "int8_ef" and out["world_size"] == 2 and out["steps"] == 6
    assert out["sent_bytes_per_step_per_rank"] > 0 and out["tokens_per_s"] > 0


def test_bench_allreduce_runs_every_method_on_a_rate_limited_link(capsys):
    """Through the CLI, inside a private network namespace with a tc-limited loopback (toy size: the
    numbers are not asserted, only what each row must hold)."""
    tiny = ["model.vocab=64", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=1"]
    argv = ["bench", "allreduce", "--ranks", "2", "--link", "400Mbit", "--steps", "4", "--json"]
    assert main([*argv, *[x for kv in tiny for x in ("--set", kv)]]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {row["method"]: row for row in r["methods"]}
    assert set(rows) == {"allreduce", "fp16", "int8_ef", "topk_ef", "local_sgd"}
    assert rows["allreduce"]["bytes_vs_allreduce"] == 1 and rows["fp16"]["bytes_vs_allreduce"] == 0.5
    assert rows["int8_ef"]["bytes_vs_allreduce"] < 0.26 and rows["topk_ef"]["bytes_vs_allreduce"] < 0.03
    assert r["link_bytes_per_s"] == 50e6 and r["ring_bound_s"] == round(r["gradient_bytes"] / 50e6, 4)
    assert all(row["step_s_median"] > 0 for row in rows.values())
