"""Small real Hugging Face checkpoints built here, never downloaded: Llama, Qwen2 and GPT-2 models from
small configs (random weights) with a byte-level BPE tokenizer trained on Python's own documentation
(``pydoc_data.topics``: the language reference as text, shipped with every CPython, so a fresh machine
has it offline). ``save_pretrained`` writes them as a user's directory looks: ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` with a chat template,
sharded safetensors and ``model.safetensors.index.json``. For the demo, the tests and the benchmarks.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from serving.hf_build_lock import BUILD

Architecture = Literal["llama", "qwen2", "gpt2"]
ARCHITECTURES: tuple[Architecture, ...] = ("llama", "qwen2", "gpt2")
EOS = "<|endoftext|>"
CACHE_ENV = "WEIGHTCAST_HF_BUILD_CACHE"
# role-tagged turns, then the assistant's tag when a reply is wanted (what `apply_chat_template` renders)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class Size:
    """The shape of a built model (GQA where the architecture has it: ``kv_heads`` < ``heads``)."""
    hidden: int = 64
    layers: int = 2
    heads: int = 2                # head_dim 32: vLLM's CPU attention takes no smaller
    kv_heads: int = 1
    intermediate: int = 128
    vocab: int = 512
    max_positions: int = 256


TINY = Size()


def size_for_bytes(nbytes: int, dtype_bytes: int = 2) -> Size:
    """A Llama-shaped size (hidden 1024, head dim 128, GQA 8/2) with as many layers as make about
    ``nbytes`` of weights: for load benchmarks (random weights, untrained)."""
    hidden, inter, kv = 1024, 2816, 256
    per_layer = (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) * dtype_bytes
    return Size(hidden=hidden, layers=max(1, round(nbytes / per_layer)), heads=8, kv_heads=2, intermediate=inter)


def corpus() -> list[str]:
    """Python's documentation topics, paragraph by paragraph."""
    import pydoc_data.topics
    return [p for text in pydoc_data.topics.topics.values() for p in text.split("\n\n") if p.strip()]


@functools.cache
def tokenizer(vocab: int = TINY.vocab):
    """A byte-level BPE tokenizer trained on ``corpus()`` (deterministic), as a transformers tokenizer
    with an end-of-text token and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config(arch: Architecture, size: Size = TINY, dtype: torch.dtype = torch.bfloat16):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config
    eos = tokenizer(size.vocab).eos_token_id
    common = dict(vocab_size=size.vocab, bos_token_id=eos, eos_token_id=eos, dtype=dtype)
    if arch == "gpt2":
        return GPT2Config(n_embd=size.hidden, n_layer=size.layers, n_head=size.heads, n_inner=size.intermediate,
                          n_positions=size.max_positions, **common)
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
               num_key_value_heads=size.kv_heads, intermediate_size=size.intermediate,
               max_position_embeddings=size.max_positions, tie_word_embeddings=False, **common)


def build(arch: Architecture, out: Path, *, seed: int = 0, size: Size = TINY, dtype: torch.dtype = torch.bfloat16,
          train_steps: int = 150, max_shard_size: str = "100KB") -> Path:
    """An ``arch`` model trained for ``train_steps`` steps on ``corpus()`` (a few seconds on a CPU at the
    tiny size) and saved at ``out`` in ``dtype``, sharded at ``max_shard_size``. Trained, because a
    random model's greedy choices are near ties that any change of arithmetic flips: golden prompts
    (``serving/golden.py``) need a model that answers decisively, as real checkpoints do.

    Where ``WEIGHTCAST_HF_BUILD_CACHE`` names a directory (the test suite sets one per run), a build of
    the same arguments, code, library versions and torch thread count is made once there and copied to
    ``out`` after that: what this build would write, without the CPU-seconds of its training."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r}: one of {', '.join(ARCHITECTURES)}")
    args = (arch, seed, size, dtype, train_steps, max_shard_size)
    cache = os.environ.get(CACHE_ENV)
    if not cache:
        return _build(*args, Path(out))
    import transformers
    key = hashlib.sha256(json.dumps([arch, seed, dataclasses.asdict(size), str(dtype), train_steps, max_shard_size,
                                     torch.__version__, transformers.__version__, torch.get_num_threads(),
                                     Path(__file__).read_text()]).encode()).hexdigest()[:24]
    root = Path(cache)
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)         # one builder per entry, across threads and processes
        if not entry.exists():
            scratch = root / f"{key}.partial"
            shutil.rmtree(scratch, ignore_errors=True)
            _build(*args, scratch)
            scratch.rename(entry)
    shutil.copytree(entry, out, dirs_exist_ok=True)
    return Path(out)


def _build(arch: Architecture, seed: int, size: Size, dtype: torch.dtype, train_steps: int, max_shard_size: str,
           out: Path) -> Path:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with BUILD:
        model = AutoModelForCausalLM.from_config(config(arch, size, dtype=torch.float32), dtype=torch.float32)
    if train_steps:
        _train(model, size, train_steps, seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    out = Path(out)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer(size.vocab).save_pretrained(out)
    for p in out.iterdir():            # save_pretrained writes 0600 shards; a published directory is readable
        p.chmod(0o644)
    return out


@functools.cache
def _tokens(vocab: int) -> torch.Tensor:
    return torch.tensor(tokenizer(vocab)("\n\n".join(corpus())).input_ids)


def _train(model, size: Size, steps: int, seed: int, batch: int = 16, seq: int = 64) -> None:
    tokens = _tokens(size.vocab)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[s:s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
