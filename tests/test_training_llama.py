"""Llama-family models (transformers' own Llama and Qwen2, grouped-query attention) trained through
the real interface: every data-parallel and tensor-parallel layout matches one process over 20 steps,
and each layout really splits the work (samples per rank, shards per rank)."""
import pytest
import torch

from training.config import ConfigError, TrainConfig
from training.launch import launch

LLAMA = ["family=llama", "kv_heads=2", "model.vocab=128", "model.d_model=64", "model.n_heads=4", "model.d_ff=128",
         "model.max_seq=16", "model.n_layers=2", "seq_len=16", "global_batch=8", "lr=1e-2", "steps=20"]


@pytest.fixture(scope="module")
def single_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("single-llama")
    res = launch(TrainConfig.load(None, [*LLAMA, "layout=single", "world_size=1", "cpu_threads=1"]), d / "run")
    return res, torch.load(d / "run" / "model.pt")


@pytest.mark.parametrize("overrides", [["layout=ddp"], ["layout=fsdp"], ["layout=tp"], ["layout=pp"],
                                       ["layout=fsdp", "activation_checkpointing=true"],
                                       ["layout=ddp", "compile=true"]], ids="-".join)
def test_llama_layouts_match_a_single_process(tmp_path, single_llama, overrides):
    """fp32, the same tolerance as the reference model's layouts (1e-4: sums in another order, carried
    by AdamW): every step's loss and every final parameter. And each layout really splits the work:
    how the samples of a step fall on the ranks, the parameter bytes each holds, and the bytes each
    puts on the wire (the kernel's count), at least what its collectives must move; a layout that ran
    the whole batch on every rank and exchanged nothing would pass the comparison but not these."""
    single, a = single_llama
    res = launch(TrainConfig.load(None, [*LLAMA, "world_size=2", "cpu_threads=1", *overrides]), tmp_path / "run",
                 timeout_s=300)
    b = torch.load(tmp_path / "run" / "model.pt")
    assert set(a) == set(b) and any("self_attn.k_proj" in k for k in a)        # the transformers Llama
    assert max(abs(x - y) for x, y in zip(single["losses"], res["losses"])) < 1e-4
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert single["losses"][-1] < single["losses"][0] - 0.3
    whole = sum(v.numel() * v.element_size() for v in a.values())
    assert single["param_bytes_by_rank"] == [whole]
    held, wire, steps = res["param_bytes_by_rank"], res["wire_bytes_sent_by_rank"], 20
    activations = 8 * 15 * 64 * 4                     # one step's hidden states: batch x (seq_len - 1) x d, fp32
    assert single["wire_bytes_sent_by_rank"] == [0] and res["step_split"]["comm_s"] > 0
    layout = overrides[0]
    if layout == "layout=ddp":                        # each rank its half of the batch, gradients all-reduced
        assert res["samples_per_step_by_rank"] == [4, 4] and res["sent_bytes_per_step_per_rank"] > 0
        assert held == [whole, whole]                 # replicas
        assert min(wire) >= steps * whole / 2         # a ring all-reduce sends (n-1)/n x 2 x the gradient
    if layout == "layout=fsdp":                       # halves of the batch, every parameter sharded in two
        assert res["samples_per_step_by_rank"] == [4, 4] and sum(held) == whole and max(held) <= whole // 2 + 1024
        assert min(wire) >= steps * 1.5 * whole / 2   # its half gathered in forward and backward, grads scattered
    if layout == "layout=tp":                         # both ranks see the whole batch, each half of every block
        assert res["samples_per_step_by_rank"] == [8, 8]
        blocks = sum(v.numel() * v.element_size() for k, v in a.items() if ".layers." in k and "norm" not in k)
        assert held[0] == held[1] == whole - blocks // 2
        assert min(wire) >= steps * 2 * 2 * activations    # 2 layers, >= 2 all-reduces of the hidden states each
    if layout == "layout=pp":                         # the whole batch through both stages, a layer on each
        assert res["samples_per_step_by_rank"] == [8, 8] and sum(held) == whole
        embed = a["lm.model.embed_tokens.weight"]
        assert held[0] - held[1] == embed.numel() * 4 - (a["lm.lm_head.weight"].numel() + 64) * 4
        assert min(wire) >= steps * activations       # activations forward, their gradients back


def test_llama_configs_are_checked_before_any_process_starts():
    with pytest.raises(ConfigError, match="kv_heads=3 needs"):
        TrainConfig.load(None, [*LLAMA, "kv_heads=3"])
    with pytest.raises(ConfigError, match="activation_checkpointing is transformers' own"):
        TrainConfig.load(None, [*LLAMA, "family=reference", "kv_heads=0", "activation_checkpointing=true"])
    with pytest.raises(ConfigError, match="does not divide kv_heads"):
        TrainConfig.load(None, [*LLAMA, "layout=tp", "world_size=4", "kv_heads=2", "model.n_heads=4"])
    with pytest.raises(ConfigError, match="family 'gpt5'"):
        TrainConfig.load(None, [*LLAMA, "family=gpt5"])


def test_a_trained_llama_exports_a_directory_transformers_loads_unchanged(tmp_path):
    """Trained on the standard library's sources with its own tokenizer, exported as bf16 shards +
    index + tokenizer: AutoModelForCausalLM and AutoTokenizer load it, and its logits are the trained
    weights' in bf16 (the export's precision: the trainer's fp32 weights rounded once) within bf16's
    rounding, the same top token everywhere."""
    import json
    import sysconfig
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.export import export_hf
    from training.models import build
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cfg = TrainConfig.load(None, [*LLAMA, "layout=single", "world_size=1", "model.vocab=512", "model.max_seq=32",
                                  "seq_len=32", f"data={stdlib}/json/*.py", "tokenizer=train",
                                  f"data_cache={tmp_path / 'cache'}"])
    res = launch(cfg, tmp_path / "run")
    assert res["losses"][-1] < res["losses"][0] - 0.3
    model = build(cfg)
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        want = model.to(torch.bfloat16)(ids).float()
    model = build(cfg)
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt"))
    out = export_hf(model, cfg, tmp_path / "export", max_shard_size="100KB")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= names and sum(n.endswith(".safetensors") for n in names) > 1
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        got = loaded(input_ids=ids).logits.float()
    # bf16 both ways; the rotary tables differ in rounding (computed in fp32 on load, cast down here)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    tok = AutoTokenizer.from_pretrained(out)
    text = (stdlib / "json" / "decoder.py").read_text()[:200]
    assert tok.decode(tok(text).input_ids) == text and tok.eos_token == "<|endoftext|>"

    # and back in: --init-from takes the family, sizes, weights and tokenizer from the directory
    again = TrainConfig.load(None, [f"init_from={out}", "layout=ddp", "world_size=2", "steps=5", "seq_len=32",
                                    "global_batch=8", "lr=1e-3", f"data={stdlib}/json/*.py",
                                    f"data_cache={tmp_path / 'cache'}"])
    assert (again.family, again.kv_heads, again.model.vocab, again.tokenizer) == ("llama", 2, 512, str(out))
    cont = launch(again, tmp_path / "again")
    assert abs(cont["losses"][0] - res["losses"][-1]) < 0.3 < res["losses"][0] - cont["losses"][0]
    with pytest.raises(ConfigError, match=r"fixes the model; drop model.d_model=32 \(its config says 64\)"):
        TrainConfig.load(None, [f"init_from={out}", "model.d_model=32"])
    with pytest.raises(ConfigError, match="no readable config.json"):
        TrainConfig.load(None, [f"init_from={tmp_path}"])


def test_activation_checkpointing_recomputes_each_layer_and_compile_compiles_it():
    from training.layouts import wrap
    from training.models import build
    from training.rank import lm_loss
    ids = torch.randint(0, 128, (2, 16))
    for ac, forwards in ((False, 1), (True, 2)):            # with it, each layer's forward runs again in backward
        model = build(TrainConfig.load(None, [*LLAMA, f"activation_checkpointing={str(ac).lower()}"])).train()
        calls = []
        # a pre-hook: the recomputation stops early once it has what backward needs, before post-hooks
        model.blocks[0].self_attn.q_proj.register_forward_pre_hook(lambda *_: calls.append(1))
        lm_loss(model, ids).backward()
        assert len(calls) == forwards
    cfg = TrainConfig.load(None, [*LLAMA, "layout=single", "world_size=1", "compile=true"])
    model = wrap(cfg, build(cfg), torch.device("cpu"), None, None)
    assert all(b._compiled_call_impl is not None for b in model.blocks)


def test_bf16_layouts_stay_as_close_to_fp32_as_bf16_itself(tmp_path, single_llama):
    """bf16 forward, fp32 master weights and gradients (FSDP2's MixedPrecisionPolicy, autocast
    elsewhere). The tolerance: a layout reorders bf16 sums, whose rounding is what separates bf16 from
    fp32 in the first place, so a layout in bf16 may be as far from the fp32 run as one bf16 process
    is, with a margin: 1.6× that distance, measured in the same test (over 20 AdamW steps at lr 1e-2:
    ~0.08 on losses and ~0.09 on parameters; layouts measured at 1.0–1.3×)."""
    single, a = single_llama
    ref = launch(TrainConfig.load(None, [*LLAMA, "layout=single", "world_size=1", "cpu_threads=1",
                                         "precision=bf16"]), tmp_path / "bf16")
    a16 = torch.load(tmp_path / "bf16" / "model.pt")

    def gap(res, b):
        return (max(abs(x - y) for x, y in zip(single["losses"], res["losses"])),
                max((a[k] - b[k]).abs().max().item() for k in a))
    bound = [1.6 * g for g in gap(ref, a16)]
    assert bound[0] > 1e-3                                 # bf16 really ran: it is not fp32
    for layout in ("ddp", "fsdp", "tp", "pp"):
        res = launch(TrainConfig.load(None, [*LLAMA, f"layout={layout}", "world_size=2", "cpu_threads=1",
                                             "precision=bf16"]), tmp_path / layout)
        got = gap(res, torch.load(tmp_path / layout / "model.pt"))
        assert got[0] <= bound[0] and got[1] <= bound[1], (layout, got, bound)
        assert res["losses"][-1] < res["losses"][0] - 0.3


def test_a_slow_rank_gets_less_of_the_batch_and_the_llama_trains_the_same(tmp_path, single_llama):
    """Rebalancing on the Llama: rank 1 computes 3x slower, its share of each step shrinks, and the
    weighted loss keeps the gradient the batch mean: the same training as one process."""
    single, a = single_llama
    res = launch(TrainConfig.load(None, [*LLAMA, "layout=ddp", "world_size=2", "cpu_threads=1", "rebalance=true",
                                         'slow_ranks={"1": 3}']), tmp_path / "run")
    fast, slow = res["samples_per_step_by_rank"]
    assert slow < fast and fast + slow == 8
    assert max(abs(x - y) for x, y in zip(single["losses"], res["losses"])) < 1e-4


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
def test_gradient_clipping_bounds_every_step_over_all_shards(tmp_path, layout):
    """SGD at lr 0.1 with the gradients' global norm clipped to 0.01: each step moves the weights by at
    most 0.001 in L2 norm, whatever the layout shards; unclipped they move ~100× more."""
    from training.models import build
    cfg = TrainConfig.load(None, [*LLAMA, f"layout={layout}", "world_size=2", "optimizer=sgd", "lr=0.1",
                                  "steps=3", "grad_clip=0.01"])
    launch(cfg, tmp_path / "clip")
    start = build(cfg).state_dict()
    end = torch.load(tmp_path / "clip" / "model.pt")
    moved = sum(((end[k] - start[k]) ** 2).sum() for k in end).sqrt().item()
    assert 0 < moved <= 3 * 0.1 * 0.01 * 1.001


def test_the_learning_rate_warms_up_then_follows_a_cosine():
    from training.step_controls import lr_at
    cfg = TrainConfig.load(None, [*LLAMA, "steps=100", "lr=1e-3", "warmup_steps=10", "schedule=cosine",
                                  "min_lr_ratio=0.1"])
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)          # linear warm-up
    assert lrs[10] == pytest.approx(1e-3) and lrs[99] == pytest.approx(1e-4)        # cosine down to 0.1 × lr
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    assert lrs[10 + 89 // 2] == pytest.approx(5.5e-4, rel=0.02)                      # half way: the mean
    flat = TrainConfig.load(None, [*LLAMA, "lr=1e-3"])
    assert {lr_at(flat, s) for s in range(20)} == {1e-3}
    with pytest.raises(ConfigError, match="grad_clip needs the norm over every stage"):
        TrainConfig.load(None, [*LLAMA, "family=reference", "kv_heads=0", "layout=pp", "grad_clip=1"])
